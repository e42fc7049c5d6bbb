"""``export: {merge: true}``: the LoRA adapter folded into its base, saved as a plain model folder (``merged/``).

The base is loaded afresh in the training dtype (never 4-bit). For QLoRA its linear weights are then replaced by
the de-quantized NF4 weights the adapter was trained against, so the merged model computes what the trained
QLoRA model computed. The adapter is loaded from the saved ``adapter/`` folder (what users get), merged with
peft's ``merge_and_unload`` and saved with the tokenizer; ``AutoModelForCausalLM.from_pretrained`` loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainq.trainer.artifacts import make_readable
from trainq.trainer.config import TrainConfig
from trainq.trainer.metrics import MetricsWriter
from trainq.trainer.modeling import resolve_precision


def dequantized_linears(model) -> dict[str, torch.Tensor]:
    """Module path (without peft's wrappers) -> de-quantized weight of every 4-bit base layer."""
    import bitsandbytes as bnb

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            clean = name.removeprefix("base_model.model.").removesuffix(".base_layer")
            out[clean] = weight.detach().cpu()
    return out


def export_merged(trained, config: TrainConfig, tokenizer, out_dir: Path, metrics: MetricsWriter) -> Path:
    """Write ``out_dir`` (model + tokenizer); returns it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = resolve_precision(config.precision).dtype
    base = AutoModelForCausalLM.from_pretrained(config.model, local_files_only=True, dtype=dtype)
    replaced = 0
    if config.method == "qlora":
        weights = dequantized_linears(trained)
        modules = dict(base.named_modules())
        with torch.no_grad():
            for name, weight in weights.items():
                modules[name].weight.copy_(weight.to(dtype))
                replaced += 1
    adapter_dir = out_dir.parent / "adapter"
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    make_readable(out_dir)
    note = f" ({replaced} de-quantized NF4 layers)" if replaced else ""
    metrics.event(
        "export",
        f"merged model written to {out_dir.name}/ in {str(dtype).removeprefix('torch.')}{note}",
        path=out_dir.name,
        dtype=str(dtype).removeprefix("torch."),
        dequantized_layers=replaced,
    )
    print(f"trainq: merged model (adapter folded into the base{note}) written to {out_dir}", flush=True)
    return out_dir
