"""A dependency chain of trivial jobs: links per second (issue 23: >= 20 links/s on a 3,000-link chain).

Each link ``chain-NNNN`` is ``true`` with ``after: [chain-(NNNN-1)]``. The whole chain is admitted
while pause.flag holds it, then the flag is removed; the figure is (links - 1) / (last link's
finished_at - first link's started_at), read from their run.json. Run it alone:

    nice .venv/bin/python bench/bench_chain.py [--links 3000] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Queue, job_yaml, kill_strays, load_average, running_watcher, wait_until
from trainq.watcher.spec.units import parse_iso

#: links per second the chain must reach (issue 23)
CHAIN_GOAL_LINKS_PER_S = 20.0


def link_id(i: int) -> str:
    return f"chain-{i:05d}"


def run_chain(work: Path, links: int) -> dict:
    """Admit a ``links``-long chain under pause.flag, release it, wait for the last link; the figures."""
    queue = Queue.create(work, {"rescan_s": 2, "status_s": 1})
    (queue.root / "pause.flag").touch()
    with running_watcher(queue.root):
        for i in range(links):
            after = f"after: [{link_id(i - 1)}]" if i else None
            queue.stage(f"{link_id(i)}.yaml", job_yaml(["true"]) + (f"{after}\n" if after else ""))
            queue.drop_staged(f"{link_id(i)}.yaml")
        wait_until(lambda: queue.count("pending") == links, 600, interval_s=0.2, what="the chain admitted")
        released = time.time()
        (queue.root / "pause.flag").unlink()
        last = queue.job_dir("done", link_id(links - 1))
        wait_until(
            lambda: (last / "run.json").exists() or queue.count("failed"),
            3600,
            interval_s=0.2,
            what="the last link done",
        )
    first_run = json.loads((queue.job_dir("done", link_id(0)) / "run.json").read_text())
    last_run = json.loads((last / "run.json").read_text())
    span = parse_iso(last_run["finished_at"]) - parse_iso(first_run["started_at"])
    return {
        "links": links,
        "failed": queue.count("failed"),
        "done": queue.count("done"),
        "span_s": round(span, 2),
        "links_per_s": round((links - 1) / span, 1),
        "release_to_last_s": round(parse_iso(last_run["finished_at"]) - released, 2),
        "load_average": [round(x, 2) for x in load_average()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=3000)
    parser.add_argument("--tmp", type=Path, default=None, help="where to make the temp queue")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainq-bench-chain-", dir=args.tmp))
    try:
        result = run_chain(work, args.links)
    finally:
        kill_strays(work)
    result["goal_links_per_s"] = CHAIN_GOAL_LINKS_PER_S
    result["met"] = result["links_per_s"] >= CHAIN_GOAL_LINKS_PER_S and result["failed"] == 0
    print(json.dumps(result))
    os.system(f"rm -rf '{work}'")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
