"""The Python stacks of a job's processes, from py-spy, into ``stacks/<time>.txt`` in the job folder (issue 30).

When the stall detector fires the watcher starts ``python -m trainq.watcher.supervisor.stacks JOB_DIR PID...``
(detached, off the loop); ``trainq why ID --stack`` calls ``capture`` directly. Each pid gets one
``py-spy dump --pid PID`` of at most ``DUMP_TIMEOUT_S``; the dumps go into one text file and
``stacks/latest.json`` says when, which pids, the innermost frames of the main thread of the first
Python process, and what went wrong (py-spy missing, no permission, not a Python process). The stalled
diagnosis quotes those frames as its evidence.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainq.watcher.spec.fsutil import atomic_write, atomic_write_json, read_json
from trainq.watcher.spec.units import iso_utc

#: longest one py-spy dump may take, seconds (a stuck target must not hold the runner)
DUMP_TIMEOUT_S = 15.0
#: frames of the main thread quoted in the evidence
INNERMOST_FRAMES = 3
#: the folder in the job folder, and the summary of the newest capture
STACKS_DIR, LATEST = "stacks", "latest.json"
_THREAD = re.compile(r'^Thread \S+ \([^)]*\)(?:: "(?P<name>[^"]*)")?')
_FRAME = re.compile(r"^\s+(?P<frame>\S.*\(.*:\d+\))\s*$")


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this interpreter (a venv's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def innermost(dump: str, count: int = INNERMOST_FRAMES) -> list[str]:
    """The first ``count`` frames of the main thread (py-spy prints the innermost first); else of the first thread."""
    threads: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        thread = _THREAD.match(line)
        if thread:
            threads.append((thread.group("name") or "", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append(frame.group("frame"))
    chosen = next((frames for name, frames in threads if name == "MainThread"), threads[0][1] if threads else [])
    return chosen[:count]


def capture(job_dir: Path, pids: list[int], why: str) -> dict:
    """Dump every pid's stacks into stacks/<time>.txt; the summary (also written to stacks/latest.json)."""
    out_dir = job_dir / STACKS_DIR
    out_dir.mkdir(exist_ok=True)
    now = time.time()
    name = iso_utc(now).replace(":", "-") + ".txt"
    exe = py_spy()
    texts: list[str] = []
    frames: list[str] = []
    errors: list[str] = []
    for pid in pids:
        if exe is None:
            errors.append("py-spy is not installed (pip install py-spy, part of the train extra): no stack recorded")
            break
        dump, error = _dump(exe, pid)
        texts.append(f"===== pid {pid} =====\n{dump or error}\n")
        if error:
            errors.append(f"pid {pid}: {error}")
        elif not frames:
            frames = innermost(dump)
    summary = {
        "at": iso_utc(now),
        "why": why,
        "pids": pids,
        "file": f"{STACKS_DIR}/{name}" if texts else None,
        "innermost": frames,
        "errors": errors,
    }
    if texts:
        atomic_write(out_dir / name, "".join(texts).encode(), durable=False)
    atomic_write_json(out_dir / LATEST, summary, durable=False)
    return summary


def _dump(exe: str, pid: int) -> tuple[str, str | None]:
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=DUMP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return "", f"py-spy gave no answer within {DUMP_TIMEOUT_S:g} s"
    except OSError as exc:
        return "", f"cannot run py-spy: {exc.strerror}"
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        reason = said[-1] if said else f"exit code {done.returncode}"
        if "ermission" in reason:
            reason += " (py-spy needs ptrace permission: run the watcher as root or allow ptrace)"
        return "", reason
    return done.stdout, None


def evidence(job_dir: Path, since: float | None = None) -> str | None:
    """A line for a stalled job's diagnosis: where its main thread waits (or why no stack was recorded)."""
    summary = read_json(job_dir / STACKS_DIR / LATEST)
    if not summary:
        return None
    from trainq.watcher.spec.units import parse_iso

    at = parse_iso(summary.get("at"))
    if since is not None and (at is None or at < since):
        return None  # from an earlier attempt
    if summary.get("innermost"):
        return "main thread in " + " <- ".join(summary["innermost"]) + f" ({summary.get('file')})"
    if summary.get("errors"):
        return "no stack recorded: " + summary["errors"][0]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m trainq.watcher.supervisor.stacks JOB_DIR PID...", file=sys.stderr)
        return 2
    summary = capture(Path(argv[0]), [int(p) for p in argv[1:]], "stalled")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
