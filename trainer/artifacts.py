"""What a finished run leaves in the job folder: adapter/ (or model/), summary.json, loss.png, env.json, SHA256SUMS."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from trainq.trainer.checkpoints import sha256_file
from trainq.trainer.metrics import read_records
from trainq.watcher.spec.contract import RECORD_EVAL, RECORD_STEP
from trainq.watcher.spec.fsutil import atomic_write, atomic_write_json
from trainq.watcher.spec.wall import attempt_cost_from_env

SUMS_FILE = "SHA256SUMS"
ENV_FILE = "env.json"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(config: dict, precision: dict, preset: dict | None) -> dict:
    """Versions, hardware and the resolved config, for env.json."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "bitsandbytes": _version("bitsandbytes"),
        "accelerate": _version("accelerate"),
        "cuda": torch.version.cuda if cuda else None,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "precision": precision,
        "preset": preset,
        "config": config,
    }


def write_env(job_dir: Path, env: dict) -> None:
    """env.json, atomically."""
    atomic_write_json(job_dir / ENV_FILE, env)


def write_summary(job_dir: Path, summary: dict) -> None:
    """summary.json, atomically; with ``cost`` (this attempt's runtime at the queue's rate) when the watcher gave one."""
    seconds = (summary.get("durations_s") or {}).get("total")
    if isinstance(seconds, (int, float)) and "cost" not in summary:
        cost = attempt_cost_from_env(float(seconds))
        if cost is not None:
            summary = {**summary, "cost": cost}
    atomic_write_json(job_dir / "summary.json", summary)


def plot_loss(metrics_path: Path, out: Path, title: str) -> None:
    """Train and eval loss against step (matplotlib Agg), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("type") == RECORD_STEP and r.get("loss") is not None]
    evals = [
        (r["step"], r["eval_loss"]) for r in records if r.get("type") == RECORD_EVAL and r.get("eval_loss") is not None
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=False), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals, strict=False), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.chmod(0o644)
    os.replace(tmp, out)


def make_readable(folder: Path) -> None:
    """chmod 0644 every file under ``folder`` (safetensors writes 0600)."""
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o644)


def write_sums(job_dir: Path, names: list[str]) -> None:
    """SHA256SUMS (``sha256sum -c`` format, paths relative to the job folder) over the named files and folders."""
    lines = []
    for name in names:
        target = job_dir / name
        files = sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
        lines += [f"{sha256_file(p)}  {p.relative_to(job_dir)}\n" for p in files if p.is_file()]
    atomic_write(job_dir / SUMS_FILE, "".join(lines))


def save_final(trainer, tokenizer, out_dir: Path) -> None:
    """The final adapter (lora/qlora) or model (full) plus tokenizer; weights only, never labelled resumable.
    The saved config gets its KV cache back (training turned it off for packing)."""
    from trainq.trainer.packing import restore_attention

    trainer.model.config.use_cache = True
    restore_attention(trainer.model)
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    make_readable(out_dir)
