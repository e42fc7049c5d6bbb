"""Where the loop's CPU goes (issue 37, item 3): trainq against the plain Trainer script of ``bench_trainer.py``,
under cProfile on a CPU clock, around ``trainer.train()`` only.

Same model (``trainq.trainer.tiny --size medium``, ~26 M parameters, unless ``--size``), same rows, LoRA, batch,
seq_len, optimizer and schedule; trainq with packing off (the same padded batches as the plain script) and its
defaults otherwise. The runners take turns (``--repeats`` each, interleaved) and every figure is per optimizer step,
summed over the repeats. Printed: each runner's CPU per step under the profiler, its garbage collections, its hot
spots (own time), the functions whose own time differs most between the two, and trainq's own code (cumulative).
cProfile adds a cost per Python call, so call-heavy code looks dearer than it is: read the differences, and take
the speed itself from ``bench_trainer.py``'s loop section, measured without a profiler.

    .venv/bin/python bench/profile_loop.py [--steps 40] [--repeats 2] [--size medium] [--top 15] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import PLAIN_TRAINER, REPO, SETTINGS, build_model, env, load_average, write_job

#: run first in each runner's process: profile Trainer.train (trainq's subclass inherits it) and time the garbage
#: collector inside that window; the profile goes to $PROFILE_OUT, the collections to $PROFILE_OUT.gc
PRELUDE = r"""
import cProfile, gc, json, os, time
import transformers
_train, _gc = transformers.Trainer.train, {"window": False, "started": 0.0, "s": [0.0, 0.0, 0.0], "n": [0, 0, 0], "freed": [0, 0, 0]}
def _on_gc(phase, info):
    if not _gc["window"]:
        return
    if phase == "start":
        _gc["started"] = time.process_time()
    else:
        _gc["s"][info["generation"]] += time.process_time() - _gc["started"]
        _gc["n"][info["generation"]] += 1
        _gc["freed"][info["generation"]] += info["collected"]
gc.callbacks.append(_on_gc)
def _profiled(self, *args, **kwargs):
    profile = cProfile.Profile(time.process_time)
    _gc["window"] = True
    profile.enable()
    try:
        return _train(self, *args, **kwargs)
    finally:
        profile.disable()
        _gc["window"] = False
        profile.dump_stats(os.environ["PROFILE_OUT"])
        with open(os.environ["PROFILE_OUT"] + ".gc", "w") as out:
            json.dump({"seconds": _gc["s"], "collections": _gc["n"], "freed": _gc["freed"]}, out)
transformers.Trainer.train = _profiled
"""

TRAINQ = (
    PRELUDE
    + r"""
import runpy, sys
sys.argv = ["trainq.trainer", sys.argv[1]]
runpy.run_module("trainq.trainer", run_name="__main__", alter_sys=True)
"""
)

PLAIN = PRELUDE + PLAIN_TRAINER


def run(code: str, argv: list[str], out: Path) -> None:
    """One runner in its own process, its profile written to ``out``."""
    subprocess.run(
        [sys.executable, "-c", code, *argv],
        check=True,
        cwd=REPO,
        env={**env(), "PROFILE_OUT": str(out)},
        capture_output=True,
    )


def short(key: tuple) -> str:
    """``function (file:line)`` with the path cut to the package."""
    file, line, name = key
    if file == "~":
        return name
    for marker in ("site-packages/", f"{REPO}/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{name} ({file}:{line})"


def merged(paths: list[Path]) -> pstats.Stats:
    stats = pstats.Stats(str(paths[0]))
    for path in paths[1:]:
        stats.add(str(path))
    return stats


def gc_line(paths: list[Path], steps: int) -> str:
    """The collections inside train(): per run, and their CPU per step."""
    seconds, count, freed = [0.0, 0.0, 0.0], [0, 0, 0], [0, 0, 0]
    for path in paths:
        found = json.loads(Path(f"{path}.gc").read_text())
        seconds = [a + b for a, b in zip(seconds, found["seconds"], strict=True)]
        count = [a + b for a, b in zip(count, found["collections"], strict=True)]
        freed = [a + b for a, b in zip(freed, found["freed"], strict=True)]
    per, runs = steps * len(paths), len(paths)
    return ", ".join(
        f"gen {g}: {count[g] / runs:.1f} per run ({freed[g] / runs:.0f} objects freed), "
        f"{1000 * seconds[g] / per:.3f} ms per step"
        for g in range(3)
    )


def hot_spots(name: str, stats: pstats.Stats, per: int, top: int) -> dict:
    """Print the runner's total and its top functions by own time; return {function: (own, cumulative, calls)}."""
    table = {short(k): (v[2] / per, v[3] / per, v[1] / per) for k, v in stats.stats.items()}  # type: ignore[attr-defined]
    total = stats.total_tt / per  # type: ignore[attr-defined]
    print(f"\n### {name}: {1000 * total:.1f} ms CPU per step under the profiler\n")
    print("| function | own ms/step | cumulative ms/step | calls/step |")
    print("|---|---|---|---|")
    for fn, (own, cum, calls) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {fn} | {1000 * own:.2f} | {1000 * cum:.2f} | {calls:.1f} |")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", default="medium", choices=("small", "medium"))
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--keep", type=Path, default=None, help="keep the .prof files here")
    args = parser.parse_args()
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="profile-loop-") as tmp:
        work = Path(tmp)
        keep = args.keep or work
        keep.mkdir(parents=True, exist_ok=True)
        model = build_model(work, args.size)
        files: dict[str, list[Path]] = {"trainq": [], "plain": []}
        for i in range(args.repeats):
            job = write_job(work / f"job-{i}", model, args.steps, packing=False)
            files["trainq"].append(keep / f"trainq-{i}.prof")
            run(TRAINQ, [str(job)], files["trainq"][-1])
            files["plain"].append(keep / f"plain-{i}.prof")
            run(PLAIN, [str(model), json.dumps(SETTINGS), str(args.steps)], files["plain"][-1])
        per = args.steps * args.repeats
        print(
            f"profile_loop: {args.steps} LoRA steps x {args.repeats} runs each, {args.size} model, batch "
            f"{SETTINGS['batch_size']} x seq_len {SETTINGS['seq_len']}, packing off, OMP_NUM_THREADS=1, cProfile on "
            f"time.process_time around trainer.train(); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load "
            f"average {before} before, {load_average()} after"
        )
        tables = {}
        for name, paths in files.items():
            tables[name] = hot_spots(name, merged(paths), per, args.top)
            print(f"\ngarbage collector inside train() ({name}): {gc_line(paths, args.steps)}")
        ours, theirs = tables["trainq"], tables["plain"]
        print("\n### own time that differs most (trainq minus plain), ms per step\n")
        print("| function | trainq | plain | difference |")
        print("|---|---|---|---|")
        keys = set(ours) | set(theirs)
        diff = {k: ours.get(k, (0, 0, 0))[0] - theirs.get(k, (0, 0, 0))[0] for k in keys}
        for fn in sorted(keys, key=lambda k: -abs(diff[k]))[: args.top]:
            print(
                f"| {fn} | {1000 * ours.get(fn, (0, 0, 0))[0]:.2f} | {1000 * theirs.get(fn, (0, 0, 0))[0]:.2f} | "
                f"{1000 * diff[fn]:+.2f} |"
            )
        print("\n### trainq's own code inside the window (cumulative ms per step)\n")
        print("| function | cumulative ms/step | calls/step |")
        print("|---|---|---|")
        own = {k: v for k, v in ours.items() if "(trainer/" in k or "(watcher/" in k}
        for fn, (_, cum, calls) in sorted(own.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"| {fn} | {1000 * cum:.3f} | {calls:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
