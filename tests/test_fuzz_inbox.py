"""Issue 12, "done when": thousands of generated job files thrown at a real watcher process.

Hypothesis generates random bytes, random text, hand-built YAML full of hostile tokens (huge
integers, pathological durations, control characters, tags, anchors, duplicate keys, deep
nesting) and valid jobs with extreme values, under ordinary and hostile file names. They are
dropped in batches into the inbox of one real ``python -m trainq.watcher`` and, after every
batch, the test shows: the same watcher pid holds the queue, every file that should leave the
inbox left it within a bounded time, and validation in-process either accepted the file or
raised InvalidJobSpec (never anything else). At the end a normal job still runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from conftest import PY, drop, wait_until
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from trainq.watcher.daemon.inbox import is_candidate_name, name_problem
from trainq.watcher.spec.config import WatcherConfig, check_command_allowed, load_watcher_config
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.jobspec import decode_spec_bytes, parse_job_text

#: files thrown in all, and per batch (the inbox is checked after each batch)
FILES = int(os.environ.get("TRAINQ_FUZZ_FILES", "2000"))
BATCH = 100
#: how long one batch may take to leave the inbox on a loaded 2-core machine
BATCH_DRAIN_S = 90.0

KEYS = [
    "approved",
    "name",
    "priority",
    "command",
    "train",
    "cwd",
    "env",
    "resources",
    "timeout",
    "stop_grace",
    "stall_after",
    "retries",
    "resume_args",
    "slurm",
    "gpus",
    "ram_gb",
    "max",
    "on",
    "backoff",
    "x",
    "ãé",
    "",
    "after",
    "after_policy",
    "on_finish",
    "sweep",
    "fork_of",
    "from_checkpoint",
    "lr",
    "train.lr",
]
HOSTILE_TOKENS = [
    "9" * 400,
    "-" + "9" * 5000,
    "0x" + "f" * 3000,
    "1e999",
    "-.inf",
    ".nan",
    "99999999999999999999",
    '"99999999999999999999s"',
    '"1' + " " * 20_000 + 'x"',
    '"\\0"',
    '"a\\0b"',
    '"\\e[2J"',
    '"\\x1b]0;pwn\\x07"',
    '"\\u2028"',
    "!!binary aGVsbG8=",
    "!!python/object/apply:os.system [echo]",
    "!!set {a}",
    "2001-12-14",
    "&a [1, 2]",
    "*a",
    "{<<: {a: 1}}",
    "[" * 40 + "]" * 40,
    "{" * 10 + "}" * 10,
    "~",
    "yes",
    "on",
    '""',
    "''",
    "0",
    "-1",
    "1.5h",
    '"0"',
    "[oom, nan]",
    "[true]",
    "{gpus: 1, ram_gb: 1e308}",
    "|\n  multi\n  line",
    '"' + "x" * 5000 + '"',
]


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar (JSON's escaping is YAML's)."""
    return json.dumps(text)


scalar_token = st.one_of(
    st.sampled_from(HOSTILE_TOKENS),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True)
    .map(repr)
    .map(lambda r: {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(r, r)),
    st.text(max_size=40).map(_quoted),
    st.from_regex(r"[0-9]{0,3}(\.[0-9]+)? {0,3}(ms|s|m|h|d|x)? {0,3}", fullmatch=True).map(_quoted),
)
value_token = st.recursive(
    scalar_token,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
        st.lists(st.tuples(st.sampled_from(KEYS), inner), max_size=4).map(
            lambda pairs: "{" + ", ".join(f"{_quoted(k)}: {v}" for k, v in pairs) + "}"
        ),
    ),
    max_leaves=8,
)


@st.composite
def hostile_yaml(draw) -> bytes:
    """A mapping written by hand: known and unknown keys (repeats allowed), hostile values."""
    pairs = draw(st.lists(st.tuples(st.sampled_from(KEYS), value_token), max_size=8))
    if draw(st.booleans()):
        pairs.insert(0, ("approved", "true"))
    if draw(st.booleans()):
        pairs.insert(1, ("command", draw(st.sampled_from(['["true"]', '"true"', '[true, "\\0"]', "[]", '""']))))
    return "".join(f"{k or '?'}: {v}\n" for k, v in pairs).encode("utf-8")


@st.composite
def extreme_valid(draw) -> bytes:
    """A valid, approved job whose every number sits at (or just inside) its documented limit."""
    fields = {
        "approved": True,
        "command": ["true"],
        "priority": draw(st.sampled_from([-(10**9), 10**9, 0])),
        "timeout": draw(st.sampled_from(["365d", 31536000, "0.001s", "1ms"])),
        "stop_grace": draw(st.sampled_from(["365d", 0, "0s"])),
        "retries": {
            "max": draw(st.sampled_from([0, 100])),
            "backoff": draw(st.sampled_from(["1s", "365d"])),
            "on": ["unknown"],
        },
        "resources": {"gpus": 0, "ram_gb": draw(st.sampled_from([0, 1e-300])), "disk_gb": 0},
        "env": {"A" * draw(st.integers(1, 300)): "x" * draw(st.integers(0, 3000))},
        "name": draw(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=200)),
    }
    return json.dumps(fields).encode("utf-8")  # JSON is YAML


job_bytes = st.one_of(
    st.binary(max_size=600),
    st.text(max_size=600).map(lambda t: t.encode("utf-8", "surrogatepass")),
    hostile_yaml(),
    extreme_valid(),
)
name_suffix = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"/", b"_").replace(b"\x00", b"_")),
    st.sampled_from([b" name with spaces", b"\n\x1b[31mforged", "ünïcødé".encode(), b"\xff\xfe", b"'\"$(x)"]),
)


def expected_to_stay(data: bytes, config: WatcherConfig, root: Path) -> bool:
    """What the watcher must do with ``data``, from the real validator in this process.

    Valid (allowed) but unapproved files stay in the inbox (awaiting approval); everything else
    leaves. Validation may only return a spec or raise InvalidJobSpec.
    """
    text = decode_spec_bytes(data)
    if isinstance(text, Problem):
        return False
    try:
        spec = parse_job_text(text, "inbox/x.yaml")
    except InvalidJobSpec:
        return False
    values = {"job_dir": str(root / "pending" / "x"), "job_id": "x", "attempt": "1"}  # as at acceptance (allow_cwd)
    return not spec.approved and check_command_allowed(spec, config, values) is None


def inbox_names(root: Path) -> set[bytes]:
    """Candidate files left in the inbox (staging folder and non-candidates aside)."""
    return {n for n in os.listdir(os.fsencode(root / "inbox")) if is_candidate_name(os.fsdecode(n))}


def test_watcher_survives_thousands_of_generated_job_files(queue_dir: Path, watcher_process) -> None:
    (queue_dir / "watcher.yaml").write_text(
        # allow_env '*': the generated env names are random (the allowlist is tested in test_default_deny.py)
        f'settle_s: 0.1\nrescan_s: 0.5\nstatus_s: 0.5\nmax_concurrent: 4\nallow_commands: ["true", {PY}]\n'
        "allow_env: ['*']\n"
    )
    config = load_watcher_config(queue_dir, {})
    wp = watcher_process(env={"TRAINQ_SIMULATE_GPUS": ""})
    wait_until(lambda: (queue_dir / "status.json").exists(), 30, what="the watcher's first status.json")
    pid = wp.proc.pid
    thrown: list[bytes] = []
    staying: set[bytes] = set()
    staging = os.fsencode(queue_dir / ".fuzz")
    os.mkdir(staging)

    def drain() -> None:
        started = time.monotonic()
        wait_until(
            lambda: inbox_names(queue_dir) <= staying or wp.proc.poll() is not None,
            BATCH_DRAIN_S,
            interval_s=0.1,
            what=f"the inbox to empty (left: {sorted(inbox_names(queue_dir) - staying)[:5]})",
        )
        assert wp.proc.poll() is None, f"the watcher died: {(queue_dir / 'watcher.stderr').read_text()[-3000:]}"
        assert (queue_dir / ".watcher.lock").read_text().strip() == str(pid)
        assert time.monotonic() - started < BATCH_DRAIN_S
        for name in staying:  # valid, unapproved: it stayed as it should; clear it for the next batch
            os.unlink(os.fsencode(queue_dir / "inbox") + b"/" + name)
        staying.clear()

    @settings(
        max_examples=FILES,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=job_bytes, suffix=name_suffix, yml=st.booleans())
    def throw(data: bytes, suffix: bytes, yml: bool) -> None:
        name = f"{len(thrown):05d}".encode() + suffix + (b".yml" if yml else b".yaml")
        with open(staging + b"/" + name, "wb") as f:
            f.write(data)
        if expected_to_stay(data, config, queue_dir) and name_problem(os.fsdecode(name)) is None:
            staying.add(name)
        os.rename(staging + b"/" + name, os.fsencode(queue_dir / "inbox") + b"/" + name)
        thrown.append(name)
        if len(thrown) % BATCH == 0:
            drain()

    throw()
    drain()
    assert len(thrown) >= FILES
    done, failed = (len(os.listdir(queue_dir / state)) for state in ("done", "failed"))
    assert done >= FILES // 50 and failed >= FILES // 4, (done, failed)  # both paths were exercised
    log = (queue_dir / "watcher.log").read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:6000]
    assert not any("\x1b" in line or "\r" in line for line in log.splitlines()), "a name forged a log line"

    drop(queue_dir, "normal.yaml", f"approved: true\npriority: 1000000000\ncommand: [{PY}, -c, 'print(6 * 7)']\n")
    wait_until(lambda: (queue_dir / "done" / "normal").exists(), 120, interval_s=0.2, what="the normal job done")
    assert "42" in (queue_dir / "done" / "normal" / "output.log").read_text()
    assert wp.proc.poll() is None and (queue_dir / ".watcher.lock").read_text().strip() == str(pid)
