"""Base model plus LoRA / QLoRA / full fine-tuning, loaded only from local folders."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import torch

from trainq.trainer.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """What ``precision`` resolved to on this machine."""

    name: str  # fp32 | bf16 | fp16
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]


def resolve_precision(requested: str) -> Precision:
    """``auto``: bf16 on compute capability >= 8, fp16 on 7.x, fp32 on older GPUs and on the CPU."""
    if requested != "auto":
        return Precision(requested, "as configured")
    if not torch.cuda.is_available():
        return Precision("fp32", "auto: no CUDA GPU")
    major, minor = torch.cuda.get_device_capability(0)
    if major >= 8:
        return Precision("bf16", f"auto: compute capability {major}.{minor} >= 8")
    if major == 7:
        return Precision("fp16", f"auto: compute capability {major}.{minor}")
    return Precision("fp32", f"auto: compute capability {major}.{minor} < 7")


#: files of which at least one means "a tokenizer was saved here"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
)


def check_tokenizer_files(model_dir: str) -> None:
    """ConfigError when the model folder holds no tokenizer at all (transformers would blame sentencepiece)."""
    from pathlib import Path

    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"train.model: {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save it "
            "beside the weights with tokenizer.save_pretrained(FOLDER)"
        )


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """The tokenizer saved beside the model; a pad token is borrowed from eos when missing; ``chat_template``
    (a Jinja file, the train.chat_template knob) replaces the saved template."""
    from pathlib import Path

    from transformers import AutoTokenizer

    check_tokenizer_files(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer


def _quantization_config(precision: Precision):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=precision.dtype,
    )


def disable_avx512bf16_repack(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU AVX512-BF16 path on every 4-bit layer; return how many layers.

    On CPUs with AVX512-BF16, running a Linear4bit in eval mode repacks its weights in place; afterwards LoRA
    gradients are silently wrong (relative error ~0.5) and the next save drifts the frozen base (~0.03).
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def uses_gradient_checkpointing(config: TrainConfig) -> bool:
    """``gradient_checkpointing`` as set; unset: the QLoRA recipe checkpoints activations on the GPU (on the CPU
    memory is not the constraint)."""
    if config.gradient_checkpointing is not None:
        return config.gradient_checkpointing
    return config.method == "qlora" and torch.cuda.is_available()


def load_base(config: TrainConfig, precision: Precision):
    """The base causal LM: 4-bit NF4 for qlora, else in the training dtype (fp32 master weights for full)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"local_files_only": True}
    if config.method == "qlora":
        kwargs["quantization_config"] = _quantization_config(precision)
        kwargs["dtype"] = precision.dtype
        # each rank's 4-bit base on its own GPU (LOCAL_RANK, set by torchrun; 0 for a single process)
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.cuda.is_available() else {"": "cpu"}
    elif config.method in ("lora", "dpo"):
        kwargs["dtype"] = precision.dtype
    else:
        kwargs["dtype"] = torch.float32  # the Trainer's autocast handles bf16/fp16; Adam wants fp32 masters
    return AutoModelForCausalLM.from_pretrained(config.model, **kwargs)


def _lora_targets(config: TrainConfig) -> str | list[str]:
    targets = config.lora.target_modules
    return "all-linear" if targets == "all-linear" else list(targets)


def attach_lora(model, config: TrainConfig):
    """Wrap ``model`` with a fresh LoRA adapter (B starts at zero, A from the seeded RNG)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if config.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=uses_gradient_checkpointing(config))
    lora = LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=_lora_targets(config),
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=config.lora.dora,
        use_rslora=config.lora.rslora,
    )
    return get_peft_model(model, lora)


def build_model(config: TrainConfig, precision: Precision):
    """Base model plus the method's trainable part, seeded so a fresh adapter is reproducible."""
    from transformers import set_seed

    set_seed(config.seed)
    model = load_base(config, precision)
    if config.method == "qlora":
        count = disable_avx512bf16_repack(model)
        logger.info("qlora: AVX512-BF16 repack disabled on %d 4-bit layers", count)
    if config.method == "full":
        return model
    return attach_lora(model, config)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must restore: the adapter for lora/qlora, every trainable weight for full."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of tensor names and exact values (to tell a loaded adapter from a fresh one)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def count_params(model) -> tuple[int, int]:
    """(trainable, total) parameters."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total
