"""docs/reference.md, the job-file and watcher.yaml reference, generated from the JSON Schemas (a test keeps it in sync).

``python -m trainq.watcher.cli.docs`` prints the page; ``python -m trainq.watcher.cli.docs --write docs/reference.md``
writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainq.watcher.spec.jobspec import SCHEMAS_DIR

#: the command that regenerates the page (named in it, and by the test that finds it stale)
WRITE_COMMAND = "python -m trainq.watcher.cli.docs --write docs/reference.md"

_INTRO = f"""# Job file and watcher.yaml reference

<!-- generated from schemas/*.schema.json by `{WRITE_COMMAND}`; do not edit by hand: a test fails when this page and
the schemas differ -->

Every field a job file (`inbox/*.yaml`) and a queue's `watcher.yaml` may hold, with its type and meaning,
straight from the JSON Schemas that the watcher validates against. Unknown keys are errors. Durations
accept `90`, `90s`, `1.5h`, `10m`, `6h`. The files themselves are described in [contract.md](contract.md).
"""


def reference() -> str:
    """The whole page: the job file (job.schema.json), its train: block (train.schema.json), watcher.yaml."""
    job = _load("job.schema.json")
    train = _load("train.schema.json")
    watcher = _load("watcher.schema.json")
    parts = [
        _INTRO,
        "## Job file",
        "",
        "`schemas/job.schema.json`",
        "",
        *_table(job, job),
        "",
        "## `train:`",
        "",
        "`schemas/train.schema.json`: the built-in trainer's knobs.",
        "",
        *_table(train, train),
        "",
        "## watcher.yaml",
        "",
        "`schemas/watcher.schema.json`: the queue's own settings, all optional.",
        "",
        *_table(watcher, watcher),
    ]
    return "\n".join(parts) + "\n"


def _load(name: str) -> dict:
    return json.loads((SCHEMAS_DIR / name).read_text(encoding="utf-8"))


def _table(schema: dict, root: dict, prefix: str = "") -> list[str]:
    rows = ["| field | type | meaning |", "|---|---|---|"] if not prefix else []
    for name, prop in schema.get("properties", {}).items():
        prop = _deref(prop, root)
        field = f"{prefix}{name}"
        rows.append(f"| `{field}` | {_type_of(prop, root)} | {_cell(prop.get('description', ''))} |")
        if prop.get("type") == "object" and prop.get("properties"):
            rows.extend(_table(prop, root, prefix=f"{field}."))
    return rows


def _deref(prop: dict, root: dict) -> dict:
    ref = prop.get("$ref", "")
    if ref.startswith("#/$defs/"):
        merged = dict(root["$defs"][ref.split("/")[-1]])
        merged.update({k: v for k, v in prop.items() if k != "$ref"})
        return merged
    return prop


def _type_of(prop: dict, root: dict) -> str:
    if "$ref" in prop and not prop["$ref"].startswith("#"):
        return f"see `{prop['$ref']}`"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    for key in ("oneOf", "anyOf"):
        if key in prop:
            return " or ".join(_type_of(_deref(p, root), root) for p in prop[key])
    kind = prop.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and isinstance(prop.get("items"), dict):
        return f"list of {_type_of(_deref(prop['items'], root), root)}"
    return kind


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def write_into(page: Path) -> bool:
    """Write the reference page; True if it changed."""
    new = reference()
    if page.exists() and page.read_text(encoding="utf-8") == new:
        return False
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(new, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainq.watcher.cli.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PAGE", help="write the reference page (docs/reference.md)")
    args = parser.parse_args(argv)
    if args.write:
        changed = write_into(Path(args.write))
        print(f"{args.write}: {'updated' if changed else 'already up to date'}")
    else:
        sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
