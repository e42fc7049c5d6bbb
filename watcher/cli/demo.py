"""``trainq demo``: the first thing a new user runs.

Builds the tiny local model and dataset (no hub), drops the example LoRA job into the inbox,
runs the watcher until the queue is idle, and says where the adapter, summary and loss plot are.
Everything goes through the same files a user would touch; the watcher never imports the
trainer (the trainer runs as ``python -m trainq.trainer`` in the job's own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainq.watcher.cli.submit import approve_text, inbox_name, read_job_text
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write

#: the example job the demo submits (its model/data paths point at ROOT/demo/, built below)
EXAMPLE = Path(__file__).resolve().parent.parent.parent / "queue" / "examples" / "lora-cpu.yaml"


def run_demo(root: Path) -> int:
    """Build, submit, watch, report; exit status 0 when the demo job reached done/."""
    root = root.resolve()
    _ensure_queue(root)
    demo_dir = root / "demo"
    if not (demo_dir / "model").is_dir():
        print(f"demo: building the tiny model and dataset in {demo_dir}/ ...", flush=True)
        subprocess.run([sys.executable, "-m", "trainq.trainer.tiny", str(demo_dir)], check=True)
    job_file = _submit_example(root)
    job_id = _id_for(job_file)
    print(
        f"demo: submitted {job_file.relative_to(root.parent) if root.parent in job_file.parents else job_file}",
        flush=True,
    )
    _watch_until_done(root, job_id)
    return _report(root, job_id)


def _ensure_queue(root: Path) -> None:
    for name in ("inbox", "pending", "running", "done", "failed"):
        (root / name).mkdir(parents=True, exist_ok=True)


def _submit_example(root: Path) -> Path:
    text = approve_text(read_job_text(EXAMPLE))
    target = inbox_name(root / "inbox", "demo-lora.yaml")
    tmp = root / "inbox" / f".{target.name}.tmp"
    atomic_write(tmp, text)
    os.replace(tmp, target)
    return target


def _id_for(job_file: Path) -> str:
    from trainq.watcher.spec.folders import id_from_name

    return id_from_name(job_file.name)


def _watch_until_done(root: Path, job_id: str) -> None:
    """Run a watcher until idle; if one already runs on this root, wait for the job instead."""
    cmd = [sys.executable, "-m", "trainq.watcher", "--root", str(root), "watch", "--until-idle"]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode == 0:
        return
    if "another watcher" not in proc.stderr:
        raise SystemExit(f"demo: the watcher failed (exit {proc.returncode})")
    print("demo: a watcher already runs on this queue; waiting for the job ...", flush=True)
    while not any((root / state / job_id).is_dir() for state in ("done", "failed")):
        time.sleep(1)


def _report(root: Path, job_id: str) -> int:
    for state in ("done", "failed"):
        job_dir = root / state / job_id
        if job_dir.is_dir():
            break
    else:
        print(f"demo: job {job_id} did not finish; see {root}/watcher.log")
        return 1
    paths = JobPaths(job_dir)
    run = json.loads(paths.run.read_text())
    print(f"\ndemo: job {job_id} finished: {run['status']}")
    if run["status"] != "done":
        print(f"  diagnosis: {run.get('diagnosis')}\n  log: {paths.log}")
        return 1
    summary = json.loads(paths.summary.read_text()) if paths.summary.exists() else {}
    for label, path in (
        ("adapter", job_dir / "adapter"),
        ("summary", paths.summary),
        ("loss plot", paths.loss_png),
        ("metrics", paths.metrics),
        ("log", paths.log),
        ("checksums", job_dir / "SHA256SUMS"),
    ):
        print(f"  {label:10} {path}")
    for key in ("final_loss", "initial_loss", "best_eval_loss", "steps", "tokens_per_s"):
        if key in summary:
            print(f"  {key:14} {summary[key]}")
    print(f"\nNext: `trainq --root {root} status`, or open {root / 'status.html'} in a browser.")
    return 0
