"""YAML 1.2 (core schema) on top of PyYAML's safe loader.

PyYAML follows YAML 1.1: ``yes``/``no``/``on``/``off`` become booleans and ``on:`` as a key
becomes ``True``. Job files are YAML 1.2, where only ``true``/``false`` are booleans.
Anchors and aliases are refused outright: job files never need them, and refusing them
closes the "billion laughs" expansion attack before anything is built.
"""

from __future__ import annotations

import re

import yaml
from yaml.constructor import SafeConstructor

try:  # the C parser is ~10x faster; resolution stays in Python either way
    from yaml import CSafeLoader as _BaseLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _BaseLoader  # type: ignore[assignment]


class Yaml12Loader(_BaseLoader):
    """Safe loader resolving plain scalars by the YAML 1.2 core schema."""


Yaml12Loader.yaml_implicit_resolvers = {}
_RESOLVERS = [
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        list("-+.0123456789"),
    ),
]
for _tag, _pattern, _first in _RESOLVERS:
    Yaml12Loader.add_implicit_resolver(_tag, re.compile(_pattern), _first)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


#: most digits an integer in a file may have; longer ones become ``HugeInt`` (int() of 5,000 digits raises,
#: and any integer past 2**63 is out of every range a job file has)
MAX_INT_DIGITS = 19


class HugeInt(str):
    """An integer literal too long to be a value: kept as its text so validation can name the field."""

    @property
    def digits(self) -> int:
        return sum(ch.isalnum() for ch in self) - (2 if self.lstrip("+-").startswith(("0o", "0x")) else 0)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int | HugeInt:
    text = loader.construct_scalar(node)
    body = text.lstrip("+-")
    if len(body) > MAX_INT_DIGITS + (2 if body.startswith(("0o", "0x")) else 0):
        return HugeInt(text)
    if text.startswith(("0o", "0x")):
        return int(text, 0)
    return int(text, 10)


def _construct_mapping(loader: SafeConstructor, node: yaml.MappingNode, deep: bool = False) -> dict:
    """Like PyYAML's, but a key written twice is an error naming the key and both lines (PyYAML keeps the last)."""
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # unhashable keys are PyYAML's to refuse
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKey(_key_text(key), seen[key], line)
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


def _key_text(key: object) -> str:
    text = str(key)
    return text if len(text) <= 40 else text[:37] + "..."


Yaml12Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
# replacing PyYAML's method on our own subclass (the stub types it as bound, so a plain function never matches)
Yaml12Loader.construct_mapping = _construct_mapping  # type: ignore[method-assign, assignment]


class YamlError(ValueError):
    """A YAML problem with the 1-based line where it was found (None when unknown)."""

    def __init__(self, message: str, line: int | None = None):
        self.line = line
        super().__init__(f"line {line}: {message}" if line else message)


class DuplicateKey(YamlError):
    """A mapping key written twice."""

    def __init__(self, key: str, first_line: int, line: int):
        super().__init__(
            f"duplicate key '{key}' (first at line {first_line}, again at line {line}); keep one of them", line
        )


def _refuse_aliases(text: str) -> None:
    for event in yaml.parse(text, Loader=_BaseLoader):
        anchor = getattr(event, "anchor", None)
        if isinstance(event, yaml.AliasEvent) or anchor:
            line = event.start_mark.line + 1 if event.start_mark else None
            raise YamlError("anchors and aliases (&, *) are not allowed in job files", line)


def _problem_text(exc: yaml.MarkedYAMLError) -> str:
    """PyYAML's problem in words that quote nothing of the file (an unknown tag is the file's own text)."""
    problem = str(exc.problem or exc.context)
    if problem.startswith("could not determine a constructor for the tag"):
        return "a YAML tag (!name) job files do not use; remove it"
    return problem


def load_yaml12(text: str) -> object:
    """Parse exactly one YAML 1.2 document; YamlError (with the line) on anything else."""
    try:
        if "&" in text or "*" in text:
            _refuse_aliases(text)
        docs = list(yaml.load_all(text, Loader=Yaml12Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise YamlError(f"YAML syntax error: {_problem_text(exc)}", line) from None
    except yaml.YAMLError as exc:
        raise YamlError(f"YAML error: {type(exc).__name__}") from None
    if len(docs) > 1:
        raise YamlError(f"expected one YAML document, found {len(docs)} (remove the extra '---')")
    return docs[0] if docs else None


class _Resolver12(yaml.resolver.BaseResolver):
    """The loader's YAML 1.2 plain-scalar rules, usable without a stream (the dumper asks them)."""


_Resolver12.yaml_implicit_resolvers = Yaml12Loader.yaml_implicit_resolvers
_RESOLVER = _Resolver12()


class _Yaml12Dumper(yaml.SafeDumper):
    """Safe dumper whose strings read back as strings under YAML 1.2 and 1.1 alike."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # quoted where a YAML 1.2 reader would take the plain form for a number, boolean or null (``1e-4``, ``0o7``);
    # PyYAML quotes what YAML 1.1 would misread (``yes``, ``on``) by itself
    tag = _RESOLVER.resolve(yaml.ScalarNode, value, (True, False))
    style = '"' if tag != "tag:yaml.org,2002:str" or "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Yaml12Dumper.add_representer(str, _represent_str)


def dump_yaml12(data: object) -> str:
    """``data`` as block-style YAML that ``load_yaml12`` reads back equal (keys in their given order)."""
    return yaml.dump(data, Dumper=_Yaml12Dumper, sort_keys=False, allow_unicode=True, width=1_000_000)
