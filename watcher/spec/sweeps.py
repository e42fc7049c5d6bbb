"""Sweeps and the other workflow fields of a job file (docs/workflows.md), as pure functions.

A sweep file becomes one concrete job per combination of its values (a grid, keys in file
order). A plain key is a placeholder (``{lr}`` in command, cwd, env, resume_args, on_finish);
a dotted key (``train.lr``) overrides that field of the job. Nothing here touches the disk
except reading the schemas once: expanding and checking are shared by the validator
(``trainq validate``), the watcher (which writes the variants' folders) and ``trainq fork``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from trainq.watcher.spec.errors import Problem

#: most jobs one sweep file may make (docs/workflows.md)
MAX_SWEEP_JOBS = 1000
#: most bytes one sweep may write in all: every job's job.yaml plus its params in run.json (values are
#: copied into every job, so a 200 KB file could become 200 MB); over it the file is rejected unwritten
MAX_SWEEP_BYTES = 16 * 1024 * 1024
#: variant problems reported before "and N more"
_MAX_VARIANT_PROBLEMS = 5
#: a combination's values quoted in a problem: how many, and how long each
_MAX_SHOWN_PARAMS = 8
_MAX_SHOWN_CHARS = 60
#: placeholders trainq itself fills; a sweep key may not reuse them
BUILTIN_PLACEHOLDERS = ("job_dir", "job_id", "attempt", "resume_from", "status")
#: fields where placeholders expand
_TEMPLATED = ("command", "cwd", "env", "resume_args", "on_finish")
_SCHEMAS_DIR = Path(__file__).resolve().parent.parent.parent / "schemas"
_AFTER_REF = re.compile(r"\{after:([^}]*)\}")
#: a placeholder a sweep key may fill: ``{lr}`` (keys are identifiers, job.schema.json)
_KEY_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Variant:
    """One combination of a sweep: its 1-based index, its values by key, and the concrete job mapping."""

    index: int
    params: dict
    data: dict


def workflow_problems(data: dict, job_problems: Callable[[dict], list[Problem]]) -> list[Problem]:
    """Rules for the section 9 fields JSON Schema cannot say; ``job_problems`` validates a variant."""
    problems = _hook_problems(data) + _after_ref_problems(data)
    sweep = data.get("sweep")
    if isinstance(sweep, dict) and sweep and all(isinstance(v, list) and v for v in sweep.values()):
        problems += sweep_problems(data, job_problems)
    return problems


def _hook_problems(data: dict) -> list[Problem]:
    hook = data.get("on_finish")
    if not isinstance(hook, str):
        return []
    try:
        shlex.split(hook)
    except ValueError as exc:
        return [Problem("on_finish", f"cannot be split like a shell would: {exc} (check the quotes)")]
    return []


def _after_ref_problems(data: dict) -> list[Problem]:
    """``{after:ID}`` must name one of the job's own ``after`` ids (anything else would expand to "")."""
    after = data.get("after", [])
    after = [after] if isinstance(after, str) else after if isinstance(after, list) else []
    problems = []
    for path, text in _templated_strings(data):
        for ref in _AFTER_REF.findall(text):
            head, _, index = ref.rpartition("-")
            if ref not in after and not (head in after and index.isdigit()):  # a job of a sweep in after
                listed = ", ".join(map(str, after)) or "nothing"
                problems.append(
                    Problem(
                        path,
                        f"{{after:{ref}}} names {ref!r}, which is not in after (after lists {listed}); add it to after",
                    )
                )
    return problems


def after_refs(data: dict) -> list[str]:
    """Every ``{after:ID}`` id the job's command, cwd, env, resume_args and on_finish use."""
    return list(dict.fromkeys(ref for _path, text in _templated_strings(data) for ref in _AFTER_REF.findall(text)))


def _templated_strings(data: dict):
    """(path, string) for every string where placeholders expand."""
    for key in _TEMPLATED:
        value = data.get(key)
        if isinstance(value, str):
            yield key, value
        elif isinstance(value, list):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, str))
        elif isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in value.items() if isinstance(v, str))


def sweep_problems(data: dict, job_problems: Callable[[dict], list[Problem]]) -> list[Problem]:
    """Keys that name nothing, too many combinations, and variants that would not validate."""
    sweep = data["sweep"]
    used = _placeholders_used(data)
    problems = [p for key in sweep for p in _key_problems(data, key, used)]
    total = math.prod(len(v) for v in sweep.values())
    if total > MAX_SWEEP_JOBS:
        sizes = " x ".join(f"{k}: {len(v)}" for k, v in sweep.items())
        biggest = max(sweep, key=lambda k: len(sweep[k]))
        problems.append(
            Problem(
                f"sweep.{biggest}",
                f"the sweep makes {total} jobs ({sizes}), over the cap of "
                f"{MAX_SWEEP_JOBS}; shorten {biggest} or split the sweep",
            )
        )
    if problems:
        return problems
    too_big = _size_problem(data)
    if too_big is not None:
        return [too_big]
    bad: list[Problem] = []
    for variant in iter_variants(data):
        for p in job_problems(variant.data):
            key = _key_for(p.path, sweep) or next(iter(sweep))
            values = ", ".join(f"{k}={_shown(v)}" for k, v in list(variant.params.items())[:_MAX_SHOWN_PARAMS])
            values += (
                f", and {len(variant.params) - _MAX_SHOWN_PARAMS} more"
                if len(variant.params) > _MAX_SHOWN_PARAMS
                else ""
            )
            bad.append(Problem(f"sweep.{key}", f"combination {variant.index} ({values}): {p.path}: {p.message}"))
        if len(bad) >= _MAX_VARIANT_PROBLEMS:
            break
    return bad[:_MAX_VARIANT_PROBLEMS]


def _placeholders_used(data: dict) -> set[str]:
    """Every ``{name}`` in the templated fields, found in one pass (not one pass per sweep key)."""
    return {name for _path, text in _templated_strings(data) for name in _KEY_REF.findall(text)}


def _size_problem(data: dict) -> Problem | None:
    """The sweep would write more than MAX_SWEEP_BYTES: counted variant by variant, stopping once over."""
    written = 0
    for variant in iter_variants(data):
        written += len(variant_text(variant.data, "x", variant.index, 1).encode("utf-8"))
        written += len(json.dumps(variant.params, ensure_ascii=False).encode("utf-8"))
        if written > MAX_SWEEP_BYTES:
            made = combinations(data["sweep"])
            return Problem(
                "sweep",
                f"the sweep's {made} jobs would write more than {MAX_SWEEP_BYTES // 2**20} MiB "
                f"(the limit MAX_SWEEP_BYTES; over it after job {variant.index}): every job "
                "copies the values it uses; use fewer combinations or shorter values, or "
                "read big values from a file",
            )
    return None


def _key_problems(data: dict, key: str, used: set[str]) -> list[Problem]:
    if "." in key:
        missing = _unknown_field(data, key.split("."))
        return [Problem(f"sweep.{key}", missing)] if missing else []
    if key in BUILTIN_PLACEHOLDERS or key.startswith("after"):
        return [
            Problem(
                f"sweep.{key}", f"{{{key}}} is a placeholder trainq fills itself; name the sweep key something else"
            )
        ]
    values = (data.get("sweep") or {}).get(key)
    items: list = values if isinstance(values, list) else []
    not_text = [i for i, v in enumerate(items) if v is None or isinstance(v, (list, dict))]
    if not_text:
        return [
            Problem(
                f"sweep.{key}[{i}]",
                "a placeholder's value is text, a number or true/false "
                f"(got {'null' if items[i] is None else 'a list' if isinstance(items[i], list) else 'a mapping'})",
            )
            for i in not_text
        ]
    if key not in used:
        return [
            Problem(
                f"sweep.{key}",
                f"a plain key is a placeholder, but {{{key}}} appears nowhere in "
                f"{', '.join(_TEMPLATED)}; use it there, or write a dotted key "
                f"(e.g. train.{key}) to override a field",
            )
        ]
    return []


def _unknown_field(data: dict, parts: list[str]) -> str | None:
    """Why a dotted key names no field of the job schema (None when it does)."""
    schema = _schema("job.schema.json")
    for depth, part in enumerate(parts):
        props = schema.get("properties") or {}
        if part not in props and schema.get("additionalProperties") not in (None, False) and depth == len(parts) - 1:
            return None  # a key of a free-form mapping: sweep: {env.X: [...]} sets env var X in each job
        if part not in props:
            where = ".".join(parts[:depth]) or "the job file"
            if parts[0] == "env":
                return (
                    f"names no field: env.{'.'.join(parts[1:])} is not a field of the job file; to sweep an "
                    f"environment variable, write a plain key (sweep: {{{parts[-1]}: [...]}}) and use it as a "
                    f'placeholder in env (env: {{{parts[-1]}: "{{{parts[-1]}}}"}})'
                )
            known = ", ".join(sorted(props)) if props else "no fields"
            return f"names no field: {where} has no {part!r} (it has {known})"
        schema = props[part]
        ref = schema.get("$ref")
        if ref and not ref.startswith("#"):
            schema = _schema(ref)
    if parts[0] == "train" and "train" not in data:
        return "overrides a train field, but this is a command job (it has no train:)"
    return None


@cache
def _schema(name: str) -> dict:
    return json.loads((_SCHEMAS_DIR / name).read_text(encoding="utf-8"))


def _key_for(path: str, sweep: dict) -> str | None:
    """The sweep key a variant's problem comes from: the dotted key the path starts with."""
    for key in sorted(sweep, key=len, reverse=True):
        if "." in key and (path == key or path.startswith(key + ".") or path.startswith(key + "[")):
            return key
    return None


def combinations(sweep: dict) -> int:
    """How many jobs a sweep mapping makes."""
    return math.prod(len(v) for v in sweep.values())


def expand(data: dict) -> list[Variant]:
    """Every combination of ``data["sweep"]`` as a concrete job mapping (no ``sweep`` key)."""
    return list(iter_variants(data))


def iter_variants(data: dict):
    """The combinations of ``expand``, one at a time (a size check stops early without building them all)."""
    sweep = data["sweep"]
    keys = list(sweep)
    base = {k: v for k, v in data.items() if k != "sweep"}
    for index, values in enumerate(itertools.product(*(sweep[k] for k in keys)), start=1):
        params = dict(zip(keys, values, strict=False))
        yield Variant(index, params, apply_params(base, params))


def apply_params(base: dict, params: dict) -> dict:
    """``base`` with dotted keys set and plain keys substituted as placeholders."""
    out = copy.deepcopy(base)
    plain = {k: _text(v) for k, v in params.items() if "." not in k}
    for key, value in params.items():
        if "." in key:
            set_dotted(out, key, value)
    if plain:
        for field in _TEMPLATED:
            if field in out:
                out[field] = _substitute(out[field], plain)
    return out


def set_dotted(data: dict, key: str, value: object) -> None:
    """``set_dotted(d, "train.lora.r", 8)``: create the mappings on the way as needed."""
    *heads, last = key.split(".")
    node = data
    for head in heads:
        if not isinstance(node.get(head), dict):
            node[head] = {}
        node = node[head]
    node[last] = value


def _substitute(value: object, plain: dict[str, str]) -> object:
    """Fill ``{key}`` placeholders in one pass over each string (linear in its length, whatever the keys).

    A value is inserted as it is: a ``{other}`` inside a value stays literal text.
    """
    if isinstance(value, str):
        if "{" not in value:
            return value
        return _KEY_REF.sub(lambda m: plain.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [_substitute(v, plain) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, plain) for k, v in value.items()}
    return value


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _shown(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str) else _text(value)
    return (
        text if len(text) <= _MAX_SHOWN_CHARS else f"{text[:_MAX_SHOWN_CHARS]}…[+{len(text) - _MAX_SHOWN_CHARS} chars]"
    )


def variant_text(data: dict, sweep_id: str, index: int, total: int) -> str:
    """A variant's job.yaml: JSON (a subset of YAML 1.2, so every value reads back exactly) under a comment."""
    head = f"# made by trainq from sweep {sweep_id}: job {index} of {total}\n"
    return head + json.dumps(data, indent=2, ensure_ascii=False) + "\n"
