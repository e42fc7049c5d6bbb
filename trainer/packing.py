"""Padding-free packing: a micro-batch becomes one flattened row with position_ids restarting per example.

transformers' ``DataCollatorWithFlattening`` builds the batch; models whose attention builds its mask with
``masking_utils`` (sdpa, eager, flex) or uses flash-attention's varlen path keep the examples apart from the
position_ids alone -- but only without a KV cache: with ``use_cache`` on (the default of most configs, also in
train mode) the mask builder skips the packed-sequence check and the rows attend to each other silently
(measured on transformers 5.24: logits off by 0.35 on the tiny model). So training runs with
``config.use_cache = False`` (restored before the final save). Whether *this* model keeps packed rows apart is
checked once at start-up, not assumed: two short rows run
packed and separately must give the same logits. ``packing`` unset: on when the check passes, off (with the
reason logged) when not; ``packing: true`` on a model that fails it is an error.

On sdpa, a packed row's block-diagonal mask still makes attention cost (sum of lengths)^2: every cross-row block is
computed and thrown away, which on the CPU ate most of what packing saves (measured: a packed step of 4 rows of
148-454 tokens no faster than the padded one). So packing switches sdpa models to ``trainq_packed_sdpa``, an
attention function registered with transformers that runs causal sdpa row by row inside a packed micro-batch
(cost: sum of lengths^2, what flash-attention's varlen path does on a GPU) and is plain sdpa otherwise (padded
batches, sliding-window masks). The start-up probe checks the switched model like any other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from trainq.trainer.config import ConfigError

#: the probe's two rows (token ids are taken modulo the vocabulary)
_PROBE_LENGTHS = (5, 7)
#: largest logit difference, relative to the logits' scale, that still counts as "the same" per dtype
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class PackingDecision:
    """Whether batches are packed, and why."""

    enabled: bool
    reason: str

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "reason": self.reason}


def probe(model) -> tuple[bool, float]:
    """(packed logits match separate ones, the relative difference) on two short rows."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = [torch.arange(3, 3 + n, device=device) % vocab for n in _PROBE_LENGTHS]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            apart = [model(input_ids=r[None]).logits[0].float() for r in rows]
            positions = torch.cat([torch.arange(len(r), device=device) for r in rows])[None]
            packed = model(input_ids=torch.cat(rows)[None], position_ids=positions).logits[0].float()
    finally:
        model.train(was_training)
    expected = torch.cat(apart)
    diff = float((packed - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
    dtype = next(model.parameters()).dtype
    return diff <= _TOLERANCE.get(dtype, 3e-2), diff


#: the attention implementation packing switches sdpa models to
PACKED_SDPA = "trainq_packed_sdpa"


def _row_bounds(position_ids: torch.Tensor) -> list[int]:
    """Start of every row in a packed (1, L) position_ids, plus L (a row starts where positions do not go up by 1)."""
    positions = position_ids[0]
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    return [0, *starts.tolist(), positions.shape[0]]


def packed_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """sdpa per packed row when the batch is one packed row without a mask; plain sdpa otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    bounds = _row_bounds(position_ids.reshape(1, -1))
    outs = [
        sdpa_attention_forward(
            module,
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
        )[0]
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(outs, dim=1), None


def packed_sdpa_mask(*args, attention_mask=None, local_size=None, **kwargs):
    """No mask for unpadded, full-attention batches (the attention function keeps rows apart); sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and local_size is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, local_size=local_size, **kwargs)


def _use_packed_sdpa(model) -> bool:
    """Switch an sdpa model to the row-by-row attention; False when the model is not sdpa or cannot switch."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "sliding_window", None):
        return False
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
    config._attn_implementation = PACKED_SDPA
    return True


def restore_attention(model) -> None:
    """Put sdpa back before a model folder is saved (the registered name exists only in a trainq process)."""
    if getattr(model.config, "_attn_implementation", None) == PACKED_SDPA:
        model.config._attn_implementation = "sdpa"


def decide(requested: bool | None, model, spec: str) -> PackingDecision:
    """Resolve ``packing`` for this model; ConfigError when packing was asked for and the model cannot."""
    if requested is False:
        return PackingDecision(False, "packing: false in the job")
    model.config.use_cache = False  # training never reads a cache; with one, packed rows would mix (see above)
    switched = _use_packed_sdpa(model)
    attn = getattr(model.config, "_attn_implementation", None) or "default"
    ok, diff = probe(model)
    if not ok and switched:
        restore_attention(model)
        attn = "sdpa"
        ok, diff = probe(model)
    if ok:
        why = "as configured" if requested else "default"
        return PackingDecision(True, f"{why}: {attn} attention keeps packed rows apart (probe difference {diff:.1e})")
    reason = (
        f"{type(model).__name__} with {attn} attention mixes packed rows (probe difference {diff:.2g}): "
        "its attention does not honour position_ids"
    )
    if requested:
        raise ConfigError(f"{spec}: train.packing: true, but {reason}; set packing: false")
    return PackingDecision(False, f"off: {reason}")


def collator(pad_id: int, enabled: bool):
    """The batch builder: flattening when packing, else padding to the longest row."""
    if enabled:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    from trainq.trainer.data import PadCollator

    return PadCollator(pad_id)
