"""``init_from: PATH``: start from existing weights with a fresh optimizer and schedule, checked shape by shape.

PATH may be:

- a trainq checkpoint (``checkpoints/step-N``: verified against its manifest first);
- a peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``: trainq's ``adapter/``, or any
  adapter saved with ``save_pretrained``): its tensors become this run's adapter (lora, qlora, dpo);
- an HF checkpoint (a ``save_pretrained`` model folder or a Trainer ``checkpoint-N``: ``model*.safetensors`` or
  ``pytorch_model*.bin``): its tensors become the model's weights (``full``) or the frozen base under a fresh
  adapter (lora, qlora, dpo).

Every tensor must land on a parameter of the same name and shape, and every adapter tensor of this model must be
given; otherwise a ConfigError names the first mismatches, so a run never trains on from a silently fresh adapter
(transformers#24252, axolotl#1134).
"""

from __future__ import annotations

from pathlib import Path

from trainq.trainer.config import ConfigError

#: peft inserts this into the names of the layers it wraps
_PEFT_BASE = ".base_layer"


def kind_of(folder: Path) -> str:
    """``trainq`` | ``adapter`` | ``model``; ConfigError when the folder is none of them."""
    if (folder / "manifest.json").is_file() or (folder / "trainq_state.json").is_file():
        return "trainq"
    if (folder / "adapter_config.json").is_file() and _files(
        folder, ("adapter_model.safetensors", "adapter_model.bin")
    ):
        return "adapter"
    if _weight_files(folder):
        return "model"
    raise ConfigError(
        f"train.init_from: {folder} holds no weights: give a peft adapter folder (adapter_config.json + "
        "adapter_model.safetensors), an HF checkpoint (model.safetensors) or a trainq checkpoints/step-N"
    )


def _files(folder: Path, names: tuple[str, ...]) -> list[Path]:
    return [folder / n for n in names if (folder / n).is_file()]


def _weight_files(folder: Path) -> list[Path]:
    found = _files(folder, ("model.safetensors", "pytorch_model.bin"))
    return found or sorted(folder.glob("model-*.safetensors")) or sorted(folder.glob("pytorch_model-*.bin"))


def read_tensors(paths: list[Path]) -> dict:
    """Every tensor of these safetensors (or torch .bin) files."""
    import torch
    from safetensors.torch import load_file

    state: dict = {}
    for path in paths:
        state.update(
            load_file(str(path))
            if path.suffix == ".safetensors"
            else torch.load(path, map_location="cpu", weights_only=True)
        )
    return state


def _check_shapes(folder: Path, given: dict, targets: dict, what: str) -> None:
    unknown = sorted(set(given) - set(targets))
    missing = sorted(set(targets) - set(given))
    if unknown or missing:
        detail = "; ".join(
            part
            for part in (
                f"{len(unknown)} not in this model (first {unknown[0]})" if unknown else "",
                f"{len(missing)} of this model's {what} not given (first {missing[0]})" if missing else "",
            )
            if part
        )
        raise ConfigError(
            f"train.init_from: {folder}: its tensors do not fit this model: {detail}; use the same model "
            "and lora settings it was trained with"
        )
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ConfigError(
                f"train.init_from: {folder}: {name} has shape {tuple(tensor.shape)}, this model's is "
                f"{tuple(targets[name].shape)}; use the same model and lora.r"
            )


def load_adapter(model, folder: Path) -> int:
    """A peft adapter folder's tensors into this model's (only) adapter; returns how many."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    if not hasattr(model, "peft_config"):
        raise ConfigError(f"train.init_from: {folder} is a LoRA adapter; method: full needs an HF checkpoint")
    given = read_tensors(_files(folder, ("adapter_model.safetensors", "adapter_model.bin")))
    targets = get_peft_model_state_dict(model)
    _check_shapes(folder, given, targets, "adapter tensors")
    with torch.no_grad():
        set_peft_model_state_dict(model, given)
    return len(given)


def load_model_weights(model, folder: Path) -> int:
    """An HF checkpoint's tensors into the model (full) or its frozen base (under an adapter); returns how many."""
    import torch

    given = read_tensors(_weight_files(folder))
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    params = {name.replace(_PEFT_BASE, ""): p for name, p in base.named_parameters() if ".lora_" not in name}
    given = {k: v for k, v in given.items() if k in params or not _is_tied_copy(k, base)}
    _check_shapes(folder, given, {k: params[k] for k in params if k in given or not _is_tied_copy(k, base)}, "weights")
    with torch.no_grad():
        for name, tensor in given.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return len(given)


def _is_tied_copy(name: str, model) -> bool:
    """The output head of a model with tied embeddings: a checkpoint may leave it out."""
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def load(model, folder: Path, method: str) -> tuple[str, int]:
    """Load ``folder``'s weights into ``model`` as its kind says; returns (kind, tensors loaded)."""
    kind = kind_of(folder)
    if kind == "trainq":
        from trainq.trainer.checkpoints import load_initial_weights

        return kind, load_initial_weights(model, folder, full=method == "full")
    if kind == "adapter":
        return kind, load_adapter(model, folder)
    return kind, load_model_weights(model, folder)
