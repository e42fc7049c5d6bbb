"""In-process checks on the real stack: QLoRA on the CPU (4-bit base untouched, correct LoRA gradients) and
gradient-accumulation invariance of the loss. Uses trainer.run's own segment runner on the tiny model."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.trainer_util import build_tiny, records, write_job
from trainq.trainer.callbacks import RunState
from trainq.trainer.config import load_config
from trainq.trainer.data import PadCollator, tokenize
from trainq.trainer.faults import Faults
from trainq.trainer.metrics import MetricsWriter
from trainq.trainer.modeling import load_tokenizer, resolve_precision
from trainq.trainer.run import Invocation, run_segment
from trainq.trainer.sources import load_data

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def keep_sigterm_handler():
    """run_segment's caller installs a SIGTERM handler in real runs; leave pytest's as it was."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def train_in_process(job: Path):
    """Run one training segment in this process; returns (Trainer, tokenizer)."""
    config = load_config(job)
    data = load_data(config.train_file, config.eval_file, config.eval_fraction)
    tokenizer = load_tokenizer(config.model)
    datasets = (tokenize(data.train, tokenizer, config.seq_len), tokenize(data.eval, tokenizer, config.seq_len))
    run = RunState(
        config=config,
        ckpt_dir=job / "checkpoints",
        stop_flag=job / "stop.flag",
        metrics=MetricsWriter(job / "metrics.jsonl"),
        faults=Faults(),
    )
    inv = Invocation(job, job / "metrics.jsonl", job / "stop.flag", 1, None)
    return run_segment(config, resolve_precision("fp32"), datasets, tokenizer, run, None, inv), tokenizer


def frozen_4bit(model) -> dict[str, bytes]:
    """The packed bytes (and quantization constants) of every 4-bit base weight."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[name] = (
                module.weight.data.cpu().numpy().tobytes() + module.weight.quant_state.absmax.cpu().numpy().tobytes()
            )
    return out


def lora_grads(model, batch) -> dict[str, torch.Tensor]:
    """Gradients of the LoRA parameters on one batch (train mode, no dropout in these jobs)."""
    model.train()
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def swap_in_dequantized(model) -> int:
    """Replace every 4-bit base layer under a LoRA layer with an fp32 nn.Linear holding its dequantized weight."""
    swapped = 0
    for module in list(model.modules()):
        base = getattr(module, "base_layer", None)
        if isinstance(base, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
            dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None)
            dense.weight = torch.nn.Parameter(weight, requires_grad=False)
            module.base_layer = dense
            swapped += 1
    return swapped


def test_qlora_on_cpu_keeps_4bit_base_bitwise_and_gradients_match_dequantized(tiny, tmp_path):
    job = write_job(
        tmp_path / "job",
        tiny,
        method="qlora",
        max_steps=8,
        eval_every=2,
        batch_size=4,
        lr=0.01,
        lora={"r": 8, "alpha": 16, "dropout": 0.0},
        checkpoint={"every_steps": 3, "keep": 2},
        log_every=4,
    )
    trainer, tokenizer = train_in_process(job)
    model = trainer.model
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    assert len(records(job, "eval")) == 4 and len(records(job, "checkpoint")) >= 2

    from trainq.trainer.modeling import disable_avx512bf16_repack, load_base

    fresh = load_base(trainer.run.config, resolve_precision("fp32"))
    disable_avx512bf16_repack(fresh)
    before = frozen_4bit(fresh)
    after = {name.removeprefix("base_model.model."): v for name, v in frozen_4bit(model).items()}
    after = {name.removesuffix(".base_layer"): v for name, v in after.items()}
    assert before.keys() == after.keys() and before == after, "evals and saves must not touch the 4-bit base"

    model.eval()
    trainer.evaluate()  # the trap fires after an eval pass: take gradients right after one
    batch = PadCollator(tokenizer.pad_token_id)([trainer.train_dataset[i] for i in range(4)])
    quantized = lora_grads(model, batch)
    assert swap_in_dequantized(model) == len(layers)
    reference = lora_grads(model, batch)
    worst = max(float((quantized[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-12)) for n in reference)
    print(f"QLoRA LoRA-gradient relative error vs dequantized reference: {worst:.2e}")
    assert worst < 1e-3


def test_loss_does_not_depend_on_the_accumulation_split(tiny, tmp_path):
    losses = {}
    for batch, accum in ((8, 1), (1, 8)):
        job = write_job(
            tmp_path / f"b{batch}",
            tiny,
            batch_size=batch,
            grad_accum=accum,
            max_steps=3,
            eval_every=None,
            lora={"dropout": 0.0},
            checkpoint={"every_steps": 100},
        )
        train_in_process(job)
        losses[(batch, accum)] = [r["loss"] for r in records(job, "step")]
    print(f"step losses batch8xaccum1 {losses[(8, 1)]} vs batch1xaccum8 {losses[(1, 8)]}")
    for a, b in zip(losses[(8, 1)], losses[(1, 8)], strict=False):
        assert abs(a - b) <= 1e-4 * abs(a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_precision_auto_and_qlora_on_cuda(tiny, tmp_path):
    major, _ = torch.cuda.get_device_capability(0)
    expected = "bf16" if major >= 8 else "fp16" if major == 7 else "fp32"
    assert resolve_precision("auto").name == expected
    job = write_job(tmp_path / "job", tiny, method="qlora", max_steps=6, eval_every=3, lora={"r": 8, "dropout": 0.0})
    trainer, _ = train_in_process(job)
    steps = records(job, "step")
    assert len(steps) == 6 and all(r["loss"] is not None for r in steps) and steps[-1]["peak_mem_mb"] > 0
    assert next(trainer.model.parameters()).is_cuda


def _has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _gradient_error_after_eval(tiny: Path, tmp_path: Path, guard: bool) -> float:
    """Worst relative LoRA-gradient error vs the de-quantized reference after one eval-mode forward pass."""
    from trainq.trainer.modeling import build_model

    job = write_job(tmp_path / f"guard-{guard}", tiny, method="qlora", lora={"r": 8, "alpha": 16, "dropout": 0.0})
    config = load_config(job)
    model = build_model(config, resolve_precision("fp32"))  # build_model applies the guard
    if not guard:
        for layer in model.modules():
            if isinstance(layer, bnb.nn.Linear4bit):
                layer.support_avx512bf16_for_cpu = True
    tokenizer = load_tokenizer(config.model)
    data = load_data(config.train_sources, config.eval_file, config.eval_fraction)
    batch = PadCollator(tokenizer.pad_token_id)([tokenize(data.train[:4], tokenizer, 48)[i] for i in range(4)])
    model.eval()
    with torch.no_grad():
        model(**batch)  # an eval pass: where the trap repacks the 4-bit weights
    quantized = lora_grads(model, batch)
    swap_in_dequantized(model)
    reference = lora_grads(model, batch)
    return max(
        float((quantized[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-12))
        for n in reference
        if reference[n].norm() > 0
    )


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the repack trap needs a CPU with avx512_bf16 (/proc/cpuinfo)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend of bitsandbytes is what this checks")
def test_avx512_bf16_guard_is_what_keeps_qlora_gradients_right(tiny, tmp_path):
    with_guard = _gradient_error_after_eval(tiny, tmp_path, guard=True)
    without = _gradient_error_after_eval(tiny, tmp_path, guard=False)
    print(f"LoRA-gradient relative error after an eval pass: with the guard {with_guard:.2e}, without {without:.2e}")
    assert with_guard < 1e-3
    assert without > 0.05, "without the guard the repacked weights corrupt the gradients on this CPU"
