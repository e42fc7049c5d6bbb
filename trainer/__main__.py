"""trainq's built-in trainer: LoRA / QLoRA / full fine-tuning of a local causal LM, driven by files.

Run by hand on any folder holding a job.yaml with a ``train:`` block::

    python -m trainq.trainer.tiny queue/demo            # a tiny model + data to try it on
    python -m trainq.trainer JOB_DIR                    # trains; writes into JOB_DIR
    touch JOB_DIR/stop.flag                      # checkpoint and stop (exit 0, outcome "stopped")
    python -m trainq.trainer JOB_DIR --resume-from JOB_DIR/checkpoints/ckpt_latest

Writes: metrics.jsonl (a record per step), checkpoints/step-NNNNNN/ + ckpt_latest/ckpt_best links,
adapter/ (model/ for method: full), summary.json, loss.png, env.json, SHA256SUMS.
Environment (set by the watcher; all optional by hand): TRAINQ_STOP_FLAG, TRAINQ_METRICS, TRAINQ_ATTEMPT,
TRAINQ_RESUME_FROM, TRAINQ_SIMULATE_GPUS (for preset: auto), TRAINQ_TRAINER_FAULTS (test switch: see trainer/faults.py).
Exit codes: 0 done or stopped, 2 bad config/checkpoint, 65 bad data, 66 diverged (NaN), 67 out of memory,
68 schedule deviation, 69 a rank never joined the group (several ranks),
143 preempted by SIGTERM (after checkpointing).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

from trainq.watcher.spec.contract import EXIT_FAILED

#: offline, quiet: models load only from local folders, and nothing phones home
_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "BITSANDBYTES_NOWELCOME": "1",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: JOB_DIR and an optional checkpoint to resume from."""
    parser = argparse.ArgumentParser(
        prog=os.environ.get("TRAINQ_PROG") or "python -m trainq.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job_dir", type=Path, help="folder holding job.yaml (outputs are written here)")
    parser.add_argument(
        "--resume-from",
        metavar="DIR",
        default=None,
        help="checkpoint folder (step-N) or checkpoints/ckpt_latest; also env TRAINQ_RESUME_FROM",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run and map errors to the documented exit codes (one stderr line each)."""
    args = parse_args(argv)
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notes are not the user's business
    from trainq.trainer.plotter import LossPlotter

    try:
        from trainq.trainer import launch

        ranks = launch.plan(args.job_dir)
        if ranks is not None:  # several ranks: this process is their torchrun agent
            return launch.launch(ranks, args.job_dir, ["--resume-from", args.resume_from] if args.resume_from else [])
    except Exception as exc:
        return _exit_code(exc)
    # started before torch is imported: matplotlib's import (~1 s) then overlaps ours and the model load, so a
    # short run finds the helper ready at the end instead of importing matplotlib itself on the critical path;
    # ranks other than 0 draw nothing: no helper for them
    plotter = LossPlotter().start() if os.environ.get("RANK", "0") == "0" else LossPlotter()
    try:
        from trainq.trainer.run import main_run

        return main_run(args.job_dir, args.resume_from, plotter)
    except Exception as exc:
        return _exit_code(exc)
    finally:
        plotter.close()  # a helper that never plotted (an error, a failed debug run) ends with us


def _exit_code(exc: Exception) -> int:
    """The documented exit code of an error, after its one stderr line (a traceback for the unexpected)."""
    code = getattr(exc, "exit_code", None)
    if code is None:
        traceback.print_exc()
        print(f"trainq: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"trainq: {exc}", file=sys.stderr)
    return code


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # interpreter shutdown with torch loaded costs ~1.3 s
