"""Memory estimate for a fine-tune, and ``preset: auto``: the largest knobs that fit a GPU's free memory.

All figures in MiB. The estimate is deliberately plain arithmetic (no torch): weights + trainable state
(fp32 weights, grads, Adam m and v = 16 bytes per trainable parameter) + activations + logits, times an
allocator-fragmentation factor, plus the CUDA context. Free memory comes from NVML, or from the simulated
GPUs file named by env ``TRAINQ_SIMULATE_GPUS`` on machines without one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from trainq.watcher.spec.contract import ENV_SIMULATE_GPUS, EXIT_USAGE

MIB = 1024 * 1024
#: share of free GPU memory a preset may plan to use
BUDGET_FRACTION = 0.85
#: CUDA context, cuBLAS workspace and kernels loaded by torch (MiB)
CUDA_CONTEXT_MB = 800
#: the caching allocator reserves more than it hands out
FRAGMENTATION = 1.15
#: NF4 with double quantization: 4 bits + ~0.127 bits of block constants per weight
NF4_BYTES = 4.127 / 8
#: fp32 weight + fp32 grad + Adam m + Adam v per trainable parameter
TRAINABLE_BYTES = 16
#: logits in fp32, their softmax and gradient
LOGIT_COPIES = 3
#: the preset shrinks seq_len and rank no further than these (or the requested value when smaller)
MIN_SEQ_LEN = 256
MIN_RANK = 8


class PresetError(Exception):
    """Raised when nothing fits the GPU (the message carries the smallest estimate)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer, read from its config.json."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """Read Llama/Qwen/Mistral-style keys (GPT-2-style names as a fallback)."""
        hidden = config.get("hidden_size") or config["n_embd"]
        heads = config.get("num_attention_heads") or config.get("n_head") or 1
        return cls(
            hidden=hidden,
            layers=config.get("num_hidden_layers") or config["n_layer"],
            intermediate=config.get("intermediate_size") or config.get("n_inner") or 4 * hidden,
            vocab=config["vocab_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer in one block: q, k, v, o, gate, up, down."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return [
            (h, h),
            (h, kv),
            (h, kv),
            (h, h),
            (h, self.intermediate),
            (h, self.intermediate),
            (self.intermediate, h),
        ]

    @property
    def linear_params(self) -> int:
        """Parameters in the blocks' linear layers (what 4-bit quantizes)."""
        return self.layers * sum(i * o for i, o in self.linear_shapes())

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params + self.layers * 2 * self.hidden

    def lora_params(self, rank: int) -> int:
        """Adapter parameters on every linear layer."""
        return self.layers * sum(rank * (i + o) for i, o in self.linear_shapes())


@dataclass(frozen=True)
class Knobs:
    """The values a preset or the OOM ladder may change."""

    seq_len: int
    batch_size: int
    grad_accum: int
    lora_r: int

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.grad_accum


@dataclass(frozen=True)
class Estimate:
    """Where the memory goes (MiB)."""

    weights_mb: float
    trainable_mb: float
    activations_mb: float
    logits_mb: float
    overhead_mb: float
    total_mb: float

    def to_dict(self) -> dict:
        return {k: round(v, 1) for k, v in asdict(self).items()}


def estimate(
    shape: ModelShape,
    method: str,
    knobs: Knobs,
    weight_bytes: float = 2,
    act_bytes: float = 2,
    gradient_checkpointing: bool | None = None,
) -> Estimate:
    """Peak training memory of one micro-batch."""
    if gradient_checkpointing is None:
        gradient_checkpointing = method == "qlora"
    if method == "full":
        weights, trainable = 0.0, shape.params * TRAINABLE_BYTES
    else:
        linear_bytes = NF4_BYTES if method == "qlora" else weight_bytes
        weights = shape.linear_params * linear_bytes + shape.embedding_params * weight_bytes
        trainable = shape.lora_params(knobs.lora_r) * TRAINABLE_BYTES
    tokens = knobs.seq_len * knobs.batch_size
    one_layer = tokens * (34 * shape.hidden + 5 * shape.heads * knobs.seq_len) * act_bytes / 2
    kept = (
        tokens * shape.hidden * act_bytes * shape.layers if gradient_checkpointing else one_layer * (shape.layers - 1)
    )
    activations = kept + one_layer
    logits = tokens * shape.vocab * 4 * LOGIT_COPIES
    allocated = (weights + trainable + activations + logits) / MIB
    overhead = allocated * (FRAGMENTATION - 1) + CUDA_CONTEXT_MB
    return Estimate(weights / MIB, trainable / MIB, activations / MIB, logits / MIB, overhead, allocated + overhead)


def _halvings(start: int, floor: int) -> list[int]:
    values = [start]
    while values[-1] // 2 >= floor:
        values.append(values[-1] // 2)
    return values


def candidates(requested: Knobs, method: str) -> list[Knobs]:
    """Knobs to try, best first: keep rank, then seq_len, then the largest batch (same effective batch)."""
    ranks = _halvings(requested.lora_r, min(MIN_RANK, requested.lora_r)) if method != "full" else [requested.lora_r]
    seqs = _halvings(requested.seq_len, min(MIN_SEQ_LEN, requested.seq_len))
    effective = requested.effective_batch
    batches = [b for b in range(effective, 0, -1) if effective % b == 0]
    return [Knobs(s, b, effective // b, r) for r in ranks for s in seqs for b in batches]


@dataclass(frozen=True)
class Choice:
    """What the preset picked, its estimate and the budget it had."""

    knobs: Knobs
    estimate: Estimate
    budget_mb: float
    free_mb: float

    def to_dict(self) -> dict:
        return {
            "knobs": asdict(self.knobs),
            "estimate": self.estimate.to_dict(),
            "budget_mb": round(self.budget_mb, 1),
            "free_mb": round(self.free_mb, 1),
        }


def choose(shape: ModelShape, method: str, requested: Knobs, free_mb: float, weight_bytes: float = 2) -> Choice:
    """The first candidate under BUDGET_FRACTION of ``free_mb``; PresetError with the smallest estimate otherwise."""
    budget = free_mb * BUDGET_FRACTION
    options = candidates(requested, method)
    for knobs in options:
        est = estimate(shape, method, knobs, weight_bytes)
        if est.total_mb <= budget:
            return Choice(knobs, est, budget, free_mb)
    smallest = estimate(shape, method, options[-1], weight_bytes)
    raise PresetError(
        f"preset: auto: nothing fits: even seq_len {options[-1].seq_len}, batch_size 1, lora.r {options[-1].lora_r} "
        f"needs ~{smallest.total_mb:.0f} MiB, over {BUDGET_FRACTION:.0%} of {free_mb:.0f} MiB free "
        f"(weights {smallest.weights_mb:.0f}, trainable {smallest.trainable_mb:.0f}, activations "
        f"{smallest.activations_mb + smallest.logits_mb:.0f}, overhead {smallest.overhead_mb:.0f}); "
        "use a smaller model, method: qlora, or a bigger GPU"
    )


def _visible_index() -> int | None:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else None


def simulated_free_mb(path: str) -> tuple[float, str] | None:
    """(free MiB, name) of the first visible GPU in a simulated GPUs file (docs/settings.md)."""
    try:
        gpus = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(gpus, list) or not gpus:
        return None
    wanted = _visible_index()
    gpu = next((g for g in gpus if g.get("index") == wanted), gpus[0])
    return float(gpu["memory_total_mb"]) - float(gpu.get("memory_used_mb", 0)), str(gpu.get("name", "simulated GPU"))


def nvml_free_mb() -> tuple[float, str] | None:
    """(free MiB, name) of the first visible GPU from NVML; None without a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(_visible_index() or 0)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return info.free / MIB, name.decode() if isinstance(name, bytes) else str(name)


def free_gpu_mb() -> tuple[float, str] | None:
    """Free memory of the GPU this job would use: the simulated file when set, else NVML."""
    simulated = os.environ.get(ENV_SIMULATE_GPUS)
    if simulated:
        return simulated_free_mb(simulated)
    return nvml_free_mb()
