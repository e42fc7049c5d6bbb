"""Trainer overhead, packing speed-up and stop latency, printed as markdown tables.

Overhead: same model (``python -m trainq.trainer.tiny --size small``), same rows, LoRA, batch, seq_len, optimizer and
schedule, three ways: ``python -m trainq.trainer`` (trainq, packing off so every runner computes the same padded
batches), a plain transformers Trainer script, and a bare PyTorch loop. Every runner is timed over the same window:
``trainer.train()`` (dataloader and optimizer set-up, the steps; trainq's summary.json ``durations_s.train`` is that
window) or, for the bare loop, from building its loader and optimizer to the last step. Whole-process time is the
subprocess from start to exit (imports, model load, training, saving).

Packing: a variable-length instruction set built here from a fixed seed (20-1000 tokens, log-normal like chat
data), one epoch, trainq with packing vs the plain Trainer with padding (same model, rows, order, LoRA without
dropout): real (non-pad) tokens/s, time to the epoch, and the largest step-loss difference between the two.

Stop latency: stop.flag touched -> process exited with a complete checkpoint.

Loop (issue 37): on the medium model (``trainq.trainer.tiny --size medium``, ~26 M parameters), packing off so every
runner computes the same padded batches, interleaved: trainq with its defaults against a plain Trainer script (CPU
per step, goal <= 1.00x), trainq with vitals off and with the update ratio at every step, and 2 ranks x batch 2
against 1 rank x batch 4 (wall time).

    .venv/bin/python bench/bench_trainer.py [--quick] [--steps N] [--repeats N] [--packing-rows N]
        [--loop-steps N] [--loop-repeats N] [--no-loop | --loop-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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
import os, sys, time, json, math
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from trainq.trainer.data import tokenize, PadCollator
from trainq.trainer.sources import load_data
from trainq.trainer.modeling import load_tokenizer
from transformers import AutoModelForCausalLM, set_seed
from peft import LoraConfig, get_peft_model
S = json.loads(sys.argv[2]); steps = int(sys.argv[3]); d = sys.argv[1]
data = load_data(S.get("data", d + "/train.jsonl"), None, 0.0)
tok = load_tokenizer(d + "/model")
ds = tokenize(data.train, tok, S["seq_len"])
set_seed(S["seed"])
model = get_peft_model(AutoModelForCausalLM.from_pretrained(d + "/model", local_files_only=True),
    LoraConfig(r=S["r"], lora_alpha=S["alpha"], lora_dropout=S["dropout"], target_modules="all-linear", task_type="CAUSAL_LM"))
collate = PadCollator(tok.pad_token_id)
if S.get("flatten"):  # the one-line alternative to padding a user would add: padding-free batches
    from transformers import DataCollatorWithFlattening
    collate = DataCollatorWithFlattening(return_position_ids=True)
_real_tokens, _collate = [0], collate
def collate(features):  # counts the real (non-pad) tokens of every batch the loop draws
    _real_tokens[0] += sum(len(f["input_ids"]) for f in features)
    return _collate(features)
"""

PLAIN_TRAINER = (
    _COMMON
    + r"""
from transformers import Trainer, TrainingArguments, TrainerCallback
length = {"max_steps": steps} if steps > 0 else {"num_train_epochs": 1}
total = steps if steps > 0 else math.ceil(len(ds) / S["batch_size"])
args = TrainingArguments(output_dir=d + "/plain", per_device_train_batch_size=S["batch_size"], **length,
    learning_rate=S["lr"], lr_scheduler_type="cosine", warmup_steps=math.ceil(0.03 * total), save_strategy="no",
    logging_strategy="steps" if S.get("log_losses") else "no", logging_steps=1, report_to="none", disable_tqdm=True, remove_unused_columns=False,
    use_cpu=True, seed=S["seed"])
losses = []
class Losses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs: losses.append(logs["loss"])
trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=[Losses()])
from transformers import PrinterCallback
trainer.remove_callback(PrinterCallback)
t0, c0 = time.perf_counter(), time.process_time(); trainer.train()
print("TRAIN_S", time.perf_counter() - t0, flush=True); print("TRAIN_CPU_S", time.process_time() - c0, flush=True)
print("TOKENS", _real_tokens[0], flush=True)
print("LOSSES", json.dumps(losses), flush=True)
os._exit(0)
"""
)

BARE_LOOP = (
    _COMMON
    + r"""
from transformers import get_scheduler
t0, c0 = time.perf_counter(), time.process_time()
loader = torch.utils.data.DataLoader(ds, batch_size=S["batch_size"], shuffle=True, collate_fn=collate,
    generator=torch.Generator().manual_seed(S["seed"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=S["lr"], fused=True)
sched = get_scheduler("cosine", opt, num_warmup_steps=math.ceil(0.03 * steps), num_training_steps=steps)
done = 0; model.train()
while done < steps:
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad(); done += 1
        if done >= steps: break
print("TRAIN_S", time.perf_counter() - t0, flush=True); print("TRAIN_CPU_S", time.process_time() - c0, flush=True)
print("TOKENS", _real_tokens[0], flush=True)
os._exit(0)
"""
)


def env() -> dict[str, str]:
    """One thread per process: the machines are 2-core and shared; every contender gets the same."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("TRAINQ_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    return out


def build_model(work: Path, size: str = "small") -> Path:
    """The benchmark model and data of ``size`` (small: a few M parameters; medium: ~26 M)."""
    folder = work / ("tiny" if size == "small" else size)
    subprocess.run(
        [sys.executable, "-m", "trainq.trainer.tiny", str(folder), "--size", size],
        check=True,
        cwd=REPO,
        env=env(),
        capture_output=True,
    )
    return folder


#: the loop section's runners on the medium model: (name, packing, extra train: knobs); plain Trainer is its own
LOOP_TRAINQ = (
    ("loop: trainq, packing off (defaults)", {}),
    ("loop: trainq, packing off, vitals off (update_ratio_every: 0)", {"health": {"update_ratio_every": 0}}),
    ("loop: trainq, packing off, update ratio every step", {"health": {"update_ratio_every": 1}}),
    ("loop: trainq, 2 ranks x batch 2, packing off", {"processes": 2, "batch_size": 2}),
)
LOOP_PLAIN = "loop: plain Trainer, padded"


def loop_comparison(work: Path, medium: Path, steps: int, repeats: int) -> dict[str, list[dict]]:
    """The loop against a plain Trainer on a >= 20 M-parameter model, same padded batches (packing off), interleaved:
    trainq with its defaults, with vitals off and with the update ratio at every step, 2 ranks x batch 2 (the same
    global batch), and the plain Trainer script."""
    results: dict[str, list[dict]] = {name: [] for name, _ in LOOP_TRAINQ}
    results[LOOP_PLAIN] = []
    for i in range(repeats):
        for n, (name, extra) in enumerate(LOOP_TRAINQ):
            results[name].append(run_trainq(work, medium, steps, f"loop{n}-{i}", packing=False, extra=extra))
        results[LOOP_PLAIN].append(run_script(PLAIN_TRAINER, medium, steps))
    return results


def print_loop(results: dict[str, list[dict]], steps: int, repeats: int, before: str, after: str) -> None:
    """The loop table: CPU per step against the plain Trainer's, wall time, tokens per second."""
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("train_s", "cpu_s", "whole_s", "tokens")}
        for k, v in results.items()
    }
    plain = med[LOOP_PLAIN]["cpu_s"]
    print(
        f"\nLoop: {steps} optimizer steps (LoRA) on the medium model (~26 M parameters), batch 4 x seq_len 64, packing off "
        f"(the same padded batches for every runner), median of {repeats}, interleaved; OMP_NUM_THREADS=1; load "
        f"average {before} before, {after} after. CPU is the trainer.train() window's (rank 0's with 2 ranks)\n"
    )
    print(
        "| loop runner | train s | train CPU s | CPU ms per step | CPU per step vs plain Trainer | real tokens/s (wall) | whole process s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in med.items():
        print(
            f"| {name} | {row['train_s']:.2f} | {row['cpu_s']:.2f} | {1000 * row['cpu_s'] / steps:.1f} | "
            f"{row['cpu_s'] / plain:.3f}x | {row['tokens'] / row['train_s']:.0f} | {row['whole_s']:.2f} |"
        )
    ours = med[LOOP_TRAINQ[0][0]]
    print(
        f"\n| loop vs plain Trainer (CPU per step; goal <= 1.00x) | {ours['cpu_s'] / plain:.3f}x |"
        f"\n| vitals cost (defaults vs vitals off, CPU per step) | "
        f"{100 * (ours['cpu_s'] / med[LOOP_TRAINQ[1][0]]['cpu_s'] - 1):+.1f} % |"
        f"\n| 2 ranks vs 1 (same global batch, wall time of train()) | "
        f"{ours['train_s'] / med[LOOP_TRAINQ[3][0]]['train_s']:.2f}x faster |"
    )


def write_job(
    job: Path, tiny: Path, steps: int, settings: dict = SETTINGS, packing: bool | None = None, extra: dict | None = None
) -> Path:
    """A trainq job with the shared settings (no eval, no checkpoint during the run); steps 0 means one epoch;
    packing None leaves the default (on where the model's attention allows it); ``extra``: more train: knobs."""
    job.mkdir(parents=True, exist_ok=True)
    length = {"max_steps": steps} if steps > 0 else {"epochs": 1}
    train = {
        "model": str(tiny / "model"),
        "data": settings.get("data", str(tiny / "train.jsonl")),
        "eval_fraction": 0,
        "method": "lora",
        **length,
        "batch_size": settings["batch_size"],
        "seq_len": settings["seq_len"],
        "lr": settings["lr"],
        "lora": {"r": settings["r"], "alpha": settings["alpha"], "dropout": settings["dropout"]},
        "seed": settings["seed"],
        "log_every": 50,
        "checkpoint": {"every_minutes": 600, "keep": 1},
        "data_cache": False,
        **({} if packing is None else {"packing": packing}),
        **(extra or {}),
    }
    (job / "job.yaml").write_text(yaml.safe_dump({"approved": True, "train": train}))
    return job


def run_trainq(
    work: Path,
    tiny: Path,
    steps: int,
    tag: str,
    settings: dict = SETTINGS,
    packing: bool | None = None,
    extra: dict | None = None,
) -> dict:
    """train_s (the trainer.train() window), its CPU seconds (rank 0's with several ranks), whole_s, tokens (real,
    every rank's), losses of `python -m trainq.trainer`."""
    job = write_job(work / f"job-{tag}", tiny, steps, settings, packing, extra)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "trainq.trainer", str(job)], check=True, cwd=REPO, env=env(), capture_output=True
    )
    whole = time.perf_counter() - start
    summary = json.loads((job / "summary.json").read_text())
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "train_s": summary["durations_s"]["train"],
        "cpu_s": summary["durations_s"]["train_cpu"],
        "whole_s": whole,
        "tokens": summary["tokens"],
        "losses": [r["loss"] for r in records if r.get("type") == "step"],
    }


def run_script(code: str, tiny: Path, steps: int, settings: dict = SETTINGS) -> dict:
    """train_s, whole_s (and tokens, losses where the script prints them) of a comparison script."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny), json.dumps(settings), str(steps)],
        check=True,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    ).stdout
    whole = time.perf_counter() - start
    found = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if " " in line}
    return {
        "train_s": float(found["TRAIN_S"]),
        "cpu_s": float(found["TRAIN_CPU_S"]),
        "whole_s": whole,
        "tokens": int(found.get("TOKENS", 0)),
        "losses": json.loads(found.get("LOSSES", "[]")),
    }


#: the packing headline's data: lengths in tokens, log-normal (median ~150) clipped to 20..1000, fixed seed
PACKING_SEED = 20261130
PACKING_MIN_TOKENS, PACKING_MAX_TOKENS = 20, 1000


def build_packing_data(tiny: Path, rows: int) -> tuple[Path, dict]:
    """A variable-length text set for the packing comparison; returns its path and its length statistics."""
    from trainq.trainer.modeling import load_tokenizer
    from trainq.trainer.tiny import sentence

    tokenizer = load_tokenizer(str(tiny / "model"))
    rng = random.Random(PACKING_SEED)
    lines, lengths = [], []
    for _ in range(rows):
        target = int(min(PACKING_MAX_TOKENS, max(PACKING_MIN_TOKENS, rng.lognormvariate(math.log(150), 0.9))))
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer(" " + sentence(rng), add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(ids[:target])
        lines.append(json.dumps({"text": text}))
        lengths.append(target)
    path = tiny / "packing.jsonl"
    path.write_text("\n".join(lines) + "\n")
    lengths.sort()
    return path, {
        "rows": rows,
        "median": lengths[rows // 2],
        "min": lengths[0],
        "max": lengths[-1],
        "mean": sum(lengths) / rows,
    }


def packing_comparison(work: Path, tiny: Path, rows: int) -> dict:
    """One epoch on the variable-length set: trainq packed vs plain Trainer padded."""
    data, stats = build_packing_data(tiny, rows)
    settings = {**SETTINGS, "data": str(data), "seq_len": 1024, "dropout": 0.0, "log_losses": True}
    packed = run_trainq(work, tiny, 0, "packed", settings, packing=True)
    padded = run_script(PLAIN_TRAINER, tiny, 0, settings)
    flattened = run_script(PLAIN_TRAINER, tiny, 0, {**settings, "flatten": True})
    pairs = list(zip(packed["losses"], padded["losses"], strict=False))
    return {
        "stats": stats,
        "packed": packed,
        "padded": padded,
        "flattened": flattened,
        "steps": len(packed["losses"]),
        "loss_diff": max((abs(a - b) for a, b in pairs if a is not None), default=float("nan")),
    }


def stop_latency(work: Path, tiny: Path) -> tuple[float, bool]:
    """Seconds from touching stop.flag to the process having exited; and whether a complete checkpoint exists."""
    job = write_job(work / "job-stop", tiny, 100_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainq.trainer", str(job)],
        cwd=REPO,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics = job / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while (
            time.monotonic() < deadline and metrics.exists() and metrics.read_text().count('"type": "step"') < 10
        ) or not metrics.exists():
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


def load_average() -> str:
    """The 1/5/15-minute load averages (quote them with every figure: the machines are shared)."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _row(name: str, r: dict, base: dict | None = None) -> str:
    rate = r["tokens"] / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
    ratio = f" | {rate / (base['tokens'] / base['cpu_s']):.2f}x" if base else " | 1.00x"
    return (
        f"| {name} | {r['tokens']} | {r['train_s']:.2f} | {r['cpu_s']:.2f} | {r['tokens'] / r['train_s']:.0f} | "
        f"{rate:.0f}{ratio} | {r['whole_s']:.2f} |"
    )


def print_overhead(results: dict[str, list[dict]], steps: int, repeats: int, before: str, after: str) -> None:
    """The small-model overhead table (the runners' real tokens per CPU-second against trainq's defaults)."""
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("train_s", "cpu_s", "whole_s", "tokens")}
        for k, v in results.items()
    }
    first = next(iter(med))
    print(
        f"\n{steps} LoRA steps on the small tiny model (median of {repeats}; OMP_NUM_THREADS=1; "
        f"load average {before} before, {after} after)\n"
    )
    print(
        "| runner | real tokens | train s | train CPU s | real tokens/s (wall) | real tokens per CPU-s | vs trainq | whole process s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, row in med.items():
        rate, base = row["tokens"] / row["cpu_s"], med[first]["tokens"] / med[first]["cpu_s"]
        print(
            f"| {name} | {row['tokens']:.0f} | {row['train_s']:.2f} | {row['cpu_s']:.2f} | "
            f"{row['tokens'] / row['train_s']:.0f} | {rate:.0f} | {rate / base:.2f}x | {row['whole_s']:.2f} |",
            flush=True,
        )


def print_packing(pack: dict, before: str, after: str) -> None:
    """The packing table: trainq packed against the plain Trainer with flattening and with padding."""
    st = pack["stats"]
    print(
        f"\nPacking: 1 epoch of {st['rows']} rows, {st['min']}-{st['max']} tokens (median {st['median']}, mean "
        f"{st['mean']:.0f}), seq_len 1024, batch {SETTINGS['batch_size']}, {pack['steps']} steps, LoRA without "
        f"dropout; load average {before} before, {after} after\n"
    )
    print(
        "| packing runner | real tokens | train s | train CPU s | real tokens/s (wall) | real tokens per CPU-s | trainq packed vs it | whole process s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(_row("trainq, packed", pack["packed"]))
    cpu_rate = lambda r: r["tokens"] / r["cpu_s"]  # noqa: E731
    for name, key in (("plain Trainer + DataCollatorWithFlattening", "flattened"), ("plain Trainer, padded", "padded")):
        r = pack[key]
        print(
            f"| {name} | {r['tokens']} | {r['train_s']:.2f} | {r['cpu_s']:.2f} | {r['tokens'] / r['train_s']:.0f} | "
            f"{cpu_rate(r):.0f} | {cpu_rate(pack['packed']) / cpu_rate(r):.2f}x | {r['whole_s']:.2f} |"
        )
    print(
        f"\n| max step-loss difference, trainq packed vs plain Trainer padded | {pack['loss_diff']:.1e} |", flush=True
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, one repeat")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--packing-rows", type=int, default=160, help="rows of the variable-length packing set")
    parser.add_argument("--loop-steps", type=int, default=40, help="steps of each loop run on the medium model")
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--no-loop", action="store_true", help="skip the medium-model loop section")
    parser.add_argument("--loop-only", action="store_true", help="only the medium-model loop section")
    args = parser.parse_args()
    steps, repeats, packing_rows = (40, 1, 48) if args.quick else (args.steps, args.repeats, args.packing_rows)
    loop_steps, loop_repeats = (10, 1) if args.quick else (args.loop_steps, args.loop_repeats)
    print(
        f"{' '.join(['bench/bench_trainer.py', *sys.argv[1:]])} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"on {os.cpu_count()} cores; load average {load_average()} at the start (each section prints when measured)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        if not args.no_loop:  # first: the section issue 37 asks about
            before = load_average()
            loop = loop_comparison(work, build_model(work, "medium"), loop_steps, loop_repeats)
            print_loop(loop, loop_steps, loop_repeats, before, load_average())
            if args.loop_only:
                return 0
        tiny = build_model(work)
        runners = {
            "trainq (defaults: packing on)": lambda i: run_trainq(work, tiny, steps, str(i)),
            "plain Trainer + DataCollatorWithFlattening": lambda i: run_script(
                PLAIN_TRAINER, tiny, steps, {**SETTINGS, "flatten": True}
            ),
            "plain Trainer, padded": lambda i: run_script(PLAIN_TRAINER, tiny, steps),
            "trainq, packing off": lambda i: run_trainq(work, tiny, steps, f"off{i}", packing=False),
            "bare loop, padded": lambda i: run_script(BARE_LOOP, tiny, steps),
        }
        before = load_average()
        results: dict[str, list[dict]] = {name: [] for name in runners}
        for i in range(repeats):  # interleaved so load changes hit every contender alike
            for name, run in runners.items():
                results[name].append(run(i))
        print_overhead(results, steps, repeats, before, load_average())
        latency, complete = stop_latency(work, tiny)
        print(
            f"\n| stop latency (flag touched -> exited) | {latency:.2f} s | checkpoint complete: {complete} |",
            flush=True,
        )
        before = load_average()
        pack = packing_comparison(work, tiny, packing_rows)
        print_packing(pack, before, load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main())
