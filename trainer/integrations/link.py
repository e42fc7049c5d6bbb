"""What a training script needs from trainq, with no framework: the job's paths, records, the stop request.

Torch-free, so a plain PyTorch loop can use it too::

    link = TrainqLink.from_env()
    link.step(step, total_steps=total, loss=loss)
    if link.stop_requested(): save(...); link.checkpoint(path, step=step); sys.exit(0)
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from trainq.trainer.metrics import MetricsWriter
from trainq.watcher.spec.contract import (
    ENV_JOB_DIR,
    ENV_METRICS,
    ENV_STOP_FLAG,
    RECORD_CHECKPOINT,
    RECORD_EVAL,
    RECORD_STEP,
)

#: the exit status of a script that saved and stopped on SIGTERM (128 + 15, as a shell reports it)
EXIT_PREEMPTED = 143


@dataclass
class TrainqLink:
    """The job's metrics file and stop flag (None outside trainq), plus whether SIGTERM arrived."""

    metrics_path: Path | None
    stop_flag: Path | None
    job_dir: Path | None
    sigterm_received: bool = False
    _writer: MetricsWriter | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> TrainqLink:
        env = os.environ if environ is None else environ

        def path(key: str) -> Path | None:
            return Path(env[key]) if env.get(key) else None

        return cls(path(ENV_METRICS), path(ENV_STOP_FLAG), path(ENV_JOB_DIR))

    @property
    def active(self) -> bool:
        """Whether the script runs under trainq."""
        return self.metrics_path is not None or self.stop_flag is not None

    def write(self, record_type: str, **fields: object) -> None:
        """Append one record to metrics.jsonl (None-valued fields left out); nothing outside trainq."""
        if self.metrics_path is None:
            return
        if self._writer is None:
            self._writer = MetricsWriter(self.metrics_path)
        self._writer.write(record_type, **{k: v for k, v in fields.items() if v is not None})

    def step(self, step: int, **fields: object) -> None:
        self.write(RECORD_STEP, step=step, **fields)

    def eval(self, step: int, eval_loss: float | None, **fields: object) -> None:
        self.write(RECORD_EVAL, step=step, eval_loss=eval_loss, **fields)

    def checkpoint(self, path: str | os.PathLike, step: int | None = None) -> None:
        """Record a complete checkpoint (absolute path): trainq resumes from the newest one."""
        self.write(RECORD_CHECKPOINT, step=step, path=os.path.abspath(path))

    def event(self, name: str, message: str) -> None:
        self.write("event", event=name, message=message)

    def stop_requested(self) -> bool:
        """The user asked to stop (stop.flag, or a timeout), or SIGTERM arrived: save and stop now."""
        return self.sigterm_received or (self.stop_flag is not None and self.stop_flag.exists())

    def catch_sigterm(self) -> bool:
        """Turn SIGTERM into a stop request at the next step boundary, if nobody else handles it.

        Only from the main thread and only over the default handler (never over a launcher's own).
        """
        if not self.active or threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        return True

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.sigterm_received = True  # a handler only sets a flag (STYLE: signal handlers do no I/O)
