"""Trainer overhead and stop latency, printed as a markdown table.

Same model (``python -m trainq.trainer.tiny --size small``), same LoRA, batch, seq_len, optimizer and schedule, three ways:
``python -m trainq.trainer`` (trainq), a plain transformers Trainer script, and a bare PyTorch loop. Training wall time
excludes imports and model loading; whole-process time includes everything. Stop latency: stop.flag touched ->
process exited with a complete checkpoint.

    .venv/bin/python bench/bench_trainer.py [--quick] [--steps N] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {"batch_size": 4, "seq_len": 64, "lr": 1e-3, "r": 16, "alpha": 16, "dropout": 0.05, "seed": 42}

_COMMON = r"""
import os, sys, time, json
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from trainq.trainer.data import tokenize, PadCollator
from trainq.trainer.sources import load_data
from trainq.trainer.modeling import load_tokenizer
from transformers import AutoModelForCausalLM, set_seed
from peft import LoraConfig, get_peft_model
S = json.loads(sys.argv[2]); steps = int(sys.argv[3]); d = sys.argv[1]
data = load_data(d + "/train.jsonl", None, 0.0)
tok = load_tokenizer(d + "/model")
ds = tokenize(data.train, tok, S["seq_len"])
set_seed(S["seed"])
model = get_peft_model(AutoModelForCausalLM.from_pretrained(d + "/model", local_files_only=True),
    LoraConfig(r=S["r"], lora_alpha=S["alpha"], lora_dropout=S["dropout"], target_modules="all-linear", task_type="CAUSAL_LM"))
collate = PadCollator(tok.pad_token_id)
"""

PLAIN_TRAINER = _COMMON + r"""
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir=d + "/plain", per_device_train_batch_size=S["batch_size"], max_steps=steps,
    learning_rate=S["lr"], lr_scheduler_type="cosine", warmup_steps=0.03, save_strategy="no", logging_strategy="no",
    report_to="none", disable_tqdm=True, remove_unused_columns=False, use_cpu=True, seed=S["seed"])
trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
t0 = time.perf_counter(); trainer.train(); print("TRAIN_S", time.perf_counter() - t0, flush=True)
os._exit(0)
"""

BARE_LOOP = _COMMON + r"""
from transformers import get_scheduler
loader = torch.utils.data.DataLoader(ds, batch_size=S["batch_size"], shuffle=True, collate_fn=collate,
    generator=torch.Generator().manual_seed(S["seed"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=S["lr"], fused=True)
sched = get_scheduler("cosine", opt, num_warmup_steps=int(0.03 * steps), num_training_steps=steps)
t0 = time.perf_counter(); done = 0; model.train()
while done < steps:
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad(); done += 1
        if done >= steps: break
print("TRAIN_S", time.perf_counter() - t0, flush=True)
os._exit(0)
"""


def env() -> dict[str, str]:
    """One thread per process: the machines are 2-core and shared; every contender gets the same."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    return out


def build_model(work: Path) -> Path:
    """The small benchmark model and data."""
    subprocess.run([sys.executable, "-m", "trainq.trainer.tiny", str(work / "tiny"), "--size", "small"], check=True,
                   cwd=REPO, env=env(), capture_output=True)
    return work / "tiny"


def write_job(job: Path, tiny: Path, steps: int) -> Path:
    """A trainq job with the shared settings (no eval, no checkpoint during the run)."""
    job.mkdir(parents=True, exist_ok=True)
    train = {"model": str(tiny / "model"), "data": str(tiny / "train.jsonl"), "eval_fraction": 0, "method": "lora",
             "max_steps": steps, "batch_size": SETTINGS["batch_size"], "seq_len": SETTINGS["seq_len"], "lr": SETTINGS["lr"],
             "lora": {"r": SETTINGS["r"], "alpha": SETTINGS["alpha"], "dropout": SETTINGS["dropout"]},
             "seed": SETTINGS["seed"], "log_every": 50, "checkpoint": {"every_minutes": 600, "keep": 1}}
    (job / "job.yaml").write_text(yaml.safe_dump({"approved": True, "train": train}))
    return job


def run_trainq(work: Path, tiny: Path, steps: int, tag: str) -> tuple[float, float]:
    """(train seconds, whole-process seconds) of `python -m trainq.trainer`."""
    job = write_job(work / f"job-{tag}", tiny, steps)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trainq.trainer", str(job)], check=True, cwd=REPO, env=env(), capture_output=True)
    whole = time.perf_counter() - start
    return json.loads((job / "summary.json").read_text())["durations_s"]["train"], whole


def run_script(code: str, tiny: Path, steps: int) -> tuple[float, float]:
    """(train seconds, whole-process seconds) of a comparison script."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(tiny), json.dumps(SETTINGS), str(steps)], check=True,
                         cwd=REPO, env=env(), capture_output=True, text=True).stdout
    whole = time.perf_counter() - start
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("TRAIN_S"))), whole


def stop_latency(work: Path, tiny: Path) -> tuple[float, bool]:
    """Seconds from touching stop.flag to the process having exited; and whether a complete checkpoint exists."""
    job = write_job(work / "job-stop", tiny, 100_000)
    proc = subprocess.Popen([sys.executable, "-m", "trainq.trainer", str(job)], cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = job / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and metrics.exists() and metrics.read_text().count('"type": "step"') < 10 or not metrics.exists():
            time.sleep(0.05)
        touched = time.perf_counter()
        (job / "stop.flag").touch()
        proc.wait(timeout=120)
        latency = time.perf_counter() - touched
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    latest = job / "checkpoints" / "ckpt_latest"
    return latency, (latest / "manifest.json").is_file()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, one repeat")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps, repeats = (40, 1) if args.quick else (args.steps, args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        tiny = build_model(work)
        results: dict[str, list[tuple[float, float]]] = {"trainq": [], "plain Trainer": [], "bare loop": []}
        for i in range(repeats):  # interleaved so load changes hit every contender alike
            results["trainq"].append(run_trainq(work, tiny, steps, str(i)))
            results["plain Trainer"].append(run_script(PLAIN_TRAINER, tiny, steps))
            results["bare loop"].append(run_script(BARE_LOOP, tiny, steps))
        latency, complete = stop_latency(work, tiny)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(w for _, w in v)) for k, v in results.items()}
    print(f"\n{steps} LoRA steps on the small tiny model (median of {repeats}; OMP_NUM_THREADS=1)\n")
    print("| runner | train s | whole process s | trainq/runner (train) | trainq/runner (whole) |")
    print("|---|---|---|---|---|")
    for name, (train_s, whole_s) in med.items():
        print(f"| {name} | {train_s:.2f} | {whole_s:.2f} | {med['trainq'][0] / train_s:.3f} | {med['trainq'][1] / whole_s:.3f} |")
    print(f"\n| stop latency (flag touched -> exited) | {latency:.2f} s | checkpoint complete: {complete} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
