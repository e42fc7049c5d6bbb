"""JSON Schema for trainq's files: one validator per schema per process, and messages written for people.

jsonschema's raw messages ("'two' is not of type 'integer'") become one line per problem that
names the field and says what was expected ("resources.gpus: must be an integer >= 0 (got
"two")"), with close-match suggestions for unknown keys. Used for job files and watcher.yaml.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import logging
import re
from pathlib import Path
from types import MappingProxyType

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from trainq.watcher.spec.errors import Problem
from trainq.watcher.spec.units import DURATION_PATTERN, MAX_DURATION_S, MAX_DURATION_TEXT

logger = logging.getLogger(__name__)

# -- JSON Schema: one validator per schema per process, and messages written for people --

_TYPE_NAMES = MappingProxyType(
    {
        "integer": "an integer",
        "number": "a number",
        "string": "a string",
        "boolean": "a boolean (true/false)",
        "object": "a mapping",
        "array": "a list",
        "null": "null",
    }
)
_PLURALS = MappingProxyType(
    {
        "integer": "integers",
        "number": "numbers",
        "string": "strings",
        "boolean": "booleans",
        "object": "mappings",
        "array": "lists",
        "null": "nulls",
    }
)
#: most problems listed for one file (the rest are counted in one line)
MAX_PROBLEMS = 50
_MORE = "and more"
_BOUNDS = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
_DURATION_HINT = "a duration like 90, 90s, 10m, 1.5h"
#: keys people put at the top level that live elsewhere (difflib cannot find them: they are spelled right)
_KEY_HOMES = (("oom_ladder", "train.oom_ladder"),)


@functools.lru_cache(maxsize=16)
def schema_validator(schemas_dir: Path, name: str) -> jsonschema.Draft202012Validator:
    """The validator for ``schemas_dir/name``, built once per process; sibling schemas resolve by ``$id``."""
    schema = json.loads((schemas_dir / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    resources = []
    for file in sorted(schemas_dir.glob("*.json")):
        contents = schema if file.name == name else _load_schema_file(file)
        if contents is None:
            continue
        resource = referencing.Resource.from_contents(contents, referencing.jsonschema.DRAFT202012)
        resources += [(uri, resource) for uri in {file.name, contents.get("$id", file.name)}]
    registry = referencing.Registry().with_resources(resources).crawl()
    return jsonschema.Draft202012Validator(_inline_local_refs(schema, schema.get("$defs", {})), registry=registry)


def _inline_local_refs(node: object, defs: dict) -> object:
    """Copy ``#/$defs/X`` targets into place: resolving a $ref per field costs ~15% of validation time."""
    if isinstance(node, list):
        return [_inline_local_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[8:] in defs:
        node = {**defs[ref[8:]], **{k: v for k, v in node.items() if k != "$ref"}}
    return {key: _inline_local_refs(value, defs) for key, value in node.items()}


def _load_schema_file(file: Path) -> dict | None:
    try:
        contents = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("schema %s: unreadable (%s); fields that refer to it cannot be checked", file, exc)
        return None
    return contents if isinstance(contents, dict) else None


def schema_problems(validator: jsonschema.Draft202012Validator, data: object) -> list[Problem]:
    """Every schema violation as a readable Problem, deduplicated and sorted by field path."""
    try:
        errors = list(itertools.islice(validator.iter_errors(data), MAX_PROBLEMS + 1))
    except referencing.exceptions.Unresolvable as exc:
        return [Problem("", f"cannot be checked: {exc} (a schema file is missing; reinstall trainq)")]
    return sort_problems([problem for error in errors for problem in _translate(error)])


def sort_problems(problems: list[Problem]) -> list[Problem]:
    """Deduplicated, whole-file problems first, then by field path; at most MAX_PROBLEMS and a line saying so.

    A 1 MiB file of 200,000 bad items must not become 200,000 lines of watcher.log and run.json.
    """
    ordered = sorted(dict.fromkeys(problems), key=_problem_key)
    if len(ordered) <= MAX_PROBLEMS:
        return ordered
    kept = [p for p in ordered if not p.message.startswith(_MORE)][:MAX_PROBLEMS]
    return [*kept, Problem("", f"{_MORE} problems not listed (the first {MAX_PROBLEMS} are); fix these first")]


def _problem_key(problem: Problem) -> tuple:
    parts = re.findall(r"\[(\d+)\]|([^.\[\]]+)", problem.path)
    return tuple((1, int(index), "") if index else (0, 0, name) for index, name in parts), problem.message


def path_text(parts: tuple | list) -> str:
    """``("retries", "on", 1)`` → ``retries.on[1]``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{field_name(part)}" if out else field_name(part))
    return out


def field_name(key: object) -> str:
    """A key as field paths show it: cut to 40 characters, non-printable characters escaped.

    Errors quote at most the key of a line they do not understand, never its value: the
    watcher may read files the person who dropped them cannot.
    """
    text = str(key)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def shown(value: object) -> str:
    """A value as JSON would spell it (strings quoted), cut to 60 characters; containers by kind."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _translate(error: jsonschema.ValidationError) -> list[Problem]:
    """One jsonschema error → the Problems a person should read."""
    parts = tuple(error.absolute_path)
    if error.validator in ("oneOf", "anyOf"):
        return _translate_alternatives(error)
    if error.validator in ("additionalProperties", "unevaluatedProperties"):
        keys = _unknown_keys(error)
        return [
            Problem(path_text((*parts, key)), _unknown_key_message(key, error.schema))
            for key in keys[: MAX_PROBLEMS + 1]
        ]
    if error.validator == "required":
        missing = [key for key in error.validator_value if key not in error.instance]
        return [Problem(path_text(parts), f"missing required key '{key}'") for key in missing]
    return [Problem(path_text(parts), _message(error))]


def _message(error: jsonschema.ValidationError) -> str:
    """The common validators in words; jsonschema's own message for the rare rest."""
    if "propertyNames" in error.absolute_schema_path:
        rule = f"it must match {error.validator_value}" if error.validator == "pattern" else _value_message(error)
        return f"key {shown(error.instance)} is not a valid name here ({rule})"
    return _value_message(error)


def _value_message(error: jsonschema.ValidationError) -> str:
    kind, value, limit, got = error.validator, error.instance, error.validator_value, shown(error.instance)
    if _is_duration(error.schema) and kind in ("type", "pattern", "minimum", "maxLength"):
        return f"expected {_DURATION_HINT} (got {got})"
    if _is_duration(error.schema) and kind == "maximum":
        return f"must be at most {MAX_DURATION_TEXT} ({MAX_DURATION_S} s) (got {got})"
    if kind in ("type", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        return f"must be {_expected(error.schema, bound=kind)} (got {got})"
    if kind in ("enum", "const"):
        choices = list(limit) if kind == "enum" else [limit]
        return f"must be {_choices(choices)} (got {got}){_suggestion(value, choices)}"
    if kind == "pattern":
        return "must not be blank" if limit == r"\S" else f"must match the pattern {limit} (got {got})"
    if kind in ("minItems", "minLength") and limit == 1:
        return "must not be empty"
    return _size_message(kind, value, limit) or error.message


def _size_message(kind: str, value: object, limit: object) -> str | None:
    size = len(value) if isinstance(value, (str, list, dict)) else 0
    messages = {
        "minItems": f"must have at least {limit} items (got {size})",
        "maxItems": f"must have at most {limit} items (got {size})",
        "minLength": f"must be at least {limit} characters long (got {size})",
        "maxLength": f"must be at most {limit} characters long (got {size})",
        "uniqueItems": "must not list the same item twice",
        "minProperties": f"must have at least {limit} keys",
        "maxProperties": f"must have at most {limit} keys",
        "multipleOf": f"must be a multiple of {limit} (got {shown(value)})",
    }
    return messages.get(kind) if kind else "is not allowed here"


def _is_duration(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("pattern") == DURATION_PATTERN


def _expected(schema: object, bound: str | None = None) -> str:
    """What a subschema accepts, in words: ``an integer >= 0``, ``a list of strings, or a string``."""
    if not isinstance(schema, dict):
        return "a valid value"
    if _is_duration(schema):
        return _DURATION_HINT
    if "enum" in schema or "const" in schema:
        return _choices(list(schema.get("enum", [schema.get("const")])))
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    if not types:
        return str(schema.get("title", "a valid value")).lower()
    text = _or_list([_type_phrase(t, schema) for t in types])
    bounds = " and ".join(f"{op} {_number(schema[key])}" for key, op in _BOUNDS if _names_bound(schema, key, bound))
    return f"{text} {bounds}" if bounds and len(types) == 1 else text


def _names_bound(schema: dict, key: str, failed: str | None) -> bool:
    """Whether a message about the ``failed`` keyword names the bound ``key`` (a wrong type: only a floor >= 0)."""
    if key not in schema:
        return False
    if failed == "type":
        return key in ("minimum", "exclusiveMinimum") and schema[key] >= 0
    return failed is None or failed == key


def _or_list(words: list[str]) -> str:
    """``a, b or c``; with ``, or`` before the last when the words hold an "or" themselves."""
    if len(words) == 1:
        return words[0]
    last = ", or " if any(" or " in w for w in words) else " or "
    return ", ".join(words[:-1]) + last + words[-1]


def _type_phrase(kind: str, schema: dict) -> str:
    items = schema.get("items")
    if kind != "array" or not isinstance(items, dict) or "type" not in items:
        return _TYPE_NAMES.get(kind, kind)
    item_types = [items["type"]] if isinstance(items["type"], str) else items["type"]
    return "a list of " + " or ".join(_PLURALS.get(t, t) for t in item_types)


def _number(value: object) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _choices(choices: list) -> str:
    words = [str(c) if isinstance(c, str) else shown(c) for c in choices]
    return words[0] if len(words) == 1 else "one of " + ", ".join(words)


def _suggestion(value: object, choices: list) -> str:
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _unknown_keys(error: jsonschema.ValidationError) -> list[str]:
    if error.validator == "unevaluatedProperties":
        return re.findall(r"'([^']*)'", error.message)  # it names them, quoted
    known = error.schema.get("properties", {})
    patterns = error.schema.get("patternProperties", {})
    return [k for k in error.instance if k not in known and not any(re.search(p, k) for p in patterns)]


def _unknown_key_message(key: str, schema: dict) -> str:
    """Name the unknown key and suggest the closest allowed one, or where it belongs."""
    known = list(schema.get("properties", {}))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6) or difflib.get_close_matches(
        key.lower(), known, n=1, cutoff=0.6
    )
    home = close[0] if close else _key_home(key, schema)
    key = f"'{field_name(key)}'"
    if home:
        return f"unknown key {key} (did you mean '{home}'?)"
    return f"unknown key {key}; allowed here: {', '.join(known)}" if known else f"unknown key {key}"


def _key_home(key: str, schema: dict) -> str | None:
    """Where a correctly spelled key lives when written one level too high (``gpus`` → ``resources.gpus``)."""
    for name, sub in schema.get("properties", {}).items():
        if isinstance(sub, dict) and key in sub.get("properties", {}):
            return f"{name}.{key}"
    return dict(_KEY_HOMES).get(key) if "train" in schema.get("properties", {}) else None


def _translate_alternatives(error: jsonschema.ValidationError) -> list[Problem]:
    """oneOf/anyOf: the "exactly one of" rule, the one branch whose type fits, or the list of forms."""
    path, got = path_text(error.absolute_path), shown(error.instance)
    if all(_is_key_branch(b) for b in error.validator_value):
        return [Problem(path, _one_of_keys_message(error))]
    if not error.context:
        return [Problem(path, f"matches more than one of the allowed forms (got {got})")]
    by_branch: dict[object, list] = {}
    for sub in error.context:
        by_branch.setdefault(sub.relative_schema_path[0], []).append(sub)
    fitting = [
        subs
        for subs in by_branch.values()
        if not any(s.validator in ("type", "enum", "const") and not s.relative_path for s in subs)
    ]
    if len(fitting) == 1:
        return [problem for sub in fitting[0] for problem in _translate(sub)]
    forms = [_expected(min(subs, key=lambda s: len(s.relative_path)).schema) for subs in by_branch.values()]
    return [Problem(path, f"must be {' or '.join(dict.fromkeys(forms))} (got {got})")]


def _is_key_branch(branch: object) -> bool:
    """A branch that only says "this key is present" (and maybe "not that one")."""
    if not isinstance(branch, dict) or len(branch.get("required", ())) != 1:
        return False
    return set(branch) <= {"required", "not", "title", "description"}


def _one_of_keys_message(error: jsonschema.ValidationError) -> str:
    names = [b["required"][0] for b in error.validator_value]
    present = [n for n in names if isinstance(error.instance, dict) and n in error.instance]
    quoted = [f"'{n}'" for n in names]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    rule = "exactly one" if error.validator == "oneOf" else "at least one"
    found = "found neither" if not present else "found " + (" and ".join(f"'{n}'" for n in present))
    if len(present) == len(names) == 2:
        found = "found both"
    return f"{rule} of {listed} is required ({found})"
