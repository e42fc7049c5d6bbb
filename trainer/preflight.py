"""Start-up checks that need no training: the model folder, its tokenizer, the LoRA target modules and the chat
template (the data is tokenized by the caller). ``debug: true`` runs them before the smoke run, so a start-up error
reports as fast as it would without debug; ``trainq preview`` runs them too.

The model is instantiated on PyTorch's ``meta`` device (shapes, no memory, no weights read), which is enough to
know its module names.
"""

from __future__ import annotations

from pathlib import Path

from trainq.trainer.config import ConfigError, TrainConfig

#: weight files of a saved model (one of them must exist)
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.pt")


def model_config(model_dir: str):
    """The model's config (ConfigError naming train.model when transformers cannot read it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"train.model: {model_dir}: not a model transformers can read: {first}") from None


def meta_model(model_dir: str):
    """The model's architecture on the meta device, or None when it cannot be built that way (the real load, which
    reports its own error, decides then)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(model_dir)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:
        return None


def check_weights(model_dir: str) -> None:
    """ConfigError when the folder has no weight file."""
    if not any(any(Path(model_dir).glob(g)) for g in WEIGHT_GLOBS):
        raise ConfigError(
            f"train.model: {model_dir} has no weights (*.safetensors or pytorch_model*.bin); save the "
            "model with save_pretrained(FOLDER)"
        )


def check_targets(model, config: TrainConfig) -> None:
    """ConfigError naming each lora.target_modules entry that matches no module of the model (peft's rule: the
    module's name, or its last dotted parts)."""
    targets = config.lora.target_modules
    if model is None or config.method == "full" or targets == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise ConfigError(
            f"train.lora.target_modules: {', '.join(missing)} matches no module of {config.model} "
            f"(its linear layers: {', '.join(leaves)})"
        )


def check_startup(config: TrainConfig, spec: Path) -> None:
    """Every start-up check that needs no training (model, weights, tokenizer, target modules, template); the
    ConfigError names the job file."""
    try:
        _check_startup(config)
    except ConfigError as exc:
        raise ConfigError(f"{spec}: {exc}") from None


def _check_startup(config: TrainConfig) -> None:
    from trainq.trainer.modeling import load_tokenizer

    if config.eval_samples_prompts is not None:
        from trainq.trainer.eval_samples import read_prompts

        read_prompts(config.eval_samples_prompts)
    check_weights(config.model)
    check_template(load_tokenizer(config.model, config.chat_template), config)
    if config.method == "full" or config.lora.target_modules == "all-linear":
        model_config(config.model)
    else:
        check_targets(meta_model(config.model), config)


def check_template(tokenizer, config: TrainConfig) -> None:
    """A chat template that is not valid Jinja is a start-up error (one that raises on some rows makes bad rows)."""
    from jinja2.exceptions import TemplateSyntaxError

    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except TemplateSyntaxError as exc:
        where = config.chat_template or f"{config.model} (the tokenizer's own template)"
        raise ConfigError(f"train.chat_template: {where}: line {exc.lineno}: {exc.message}") from None
    except Exception:
        return
