"""The ``train:`` block of a job file, validated against ``schemas/train.schema.json`` into a frozen ``TrainConfig``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from trainq.watcher.spec.contract import EXIT_USAGE
from trainq.watcher.spec.yaml12 import YamlError, load_yaml12

#: the schema this module validates against (shipped beside the package in the repo)
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "train.schema.json"


class ConfigError(Exception):
    """Raised when job.yaml or its train: block is unusable; the message is one line naming file and field."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class LoraConfig:
    """Adapter shape for lora/qlora."""

    r: int = 16
    alpha: float = 16
    dropout: float = 0.05
    target_modules: str | tuple[str, ...] = "all-linear"
    dora: bool = False  # weight-decomposed LoRA (peft use_dora)
    rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r) (peft use_rslora)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint cadence (steps or minutes, whichever first) and retention."""

    every_steps: int | None = None
    every_minutes: float = 30.0
    keep: int = 2


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a train job, with relative paths already resolved."""

    model: str
    train_sources: tuple[tuple[str, float], ...]  # (file, weight): weight 2 repeats every row twice, 0.5 keeps half
    eval_file: str | None = None
    method: str = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    seq_len: int = 512
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 2e-4
    scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    epochs: float | None = None
    max_steps: int | None = None
    precision: str = "auto"
    seed: int = 42
    eval_every: int | None = None
    log_every: int = 10
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preset: str | None = None
    oom_ladder: str = "auto"
    eval_fraction: float = 0.05
    allow_changed_schedule: bool = False
    train_on: str = "assistant"
    packing: bool | None = None  # None: on where the model's attention honours position_ids
    max_bad_rows: float = 0  # a count (>= 1) or a share of rows (< 1)
    allow_changed_data: bool = False
    debug: bool = False
    export_merge: bool = False
    report_to: tuple[str, ...] = ()
    gradient_checkpointing: bool | None = None  # None: on for QLoRA on a GPU
    optim: str | None = None  # None: transformers' default (adamw_torch_fused with torch >= 2.8)
    data_cache: bool = True
    health: dict | None = None  # thresholds of the vital signs: {clip_fraction, update_ratio} (trainer/vitals.py)
    max_minutes_per_attempt: float | None = None  # then save and exit EXIT_CHECKPOINT (85): time-sliced training
    processes: int | None = None  # ranks per node; None: one per GPU given, 1 without GPUs (trainer/distributed.py)
    strategy: str = "ddp"  # ddp | fsdp
    oversubscribe: bool = False  # allow more CPU ranks than usable cores (watcher/spec/capacity.py): one warning
    init_from: str | None = None  # a peft adapter folder or HF checkpoint: starting weights, fresh optimizer
    early_stopping_patience: int | None = None  # evals without an improvement of min_delta before stopping
    early_stopping_min_delta: float = 0.0
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's chat template
    eval_samples_prompts: str | None = None  # JSONL of prompts generated from at each eval (samples.jsonl)
    eval_samples_max_new_tokens: int = 64
    dpo_beta: float = 0.1  # method: dpo: strength of the pull towards the reference model

    @property
    def train_file(self) -> str:
        """The first training file (for messages)."""
        return self.train_sources[0][0]

    @property
    def effective_batch(self) -> int:
        """Examples per optimizer step."""
        return self.batch_size * self.grad_accum

    @classmethod
    def from_dict(cls, block: dict, base_dirs: tuple[Path, ...]) -> TrainConfig:
        """Build from an already schema-valid ``train:`` block; relative paths resolve against ``base_dirs``."""
        values = {
            k: v
            for k, v in block.items()
            if k not in ("data", "lora", "checkpoint", "export", "report_to", "early_stopping", "eval_samples", "dpo")
        }
        values["model"] = _resolve(block["model"], base_dirs)
        values.update(_round_three(block, base_dirs))
        data = block["data"]
        if isinstance(data, str):
            values["train_sources"] = ((_resolve(data, base_dirs), 1.0),)
        else:
            train = data["train"] if isinstance(data["train"], list) else [data["train"]]
            values["train_sources"] = tuple(
                (_resolve(t, base_dirs), 1.0)
                if isinstance(t, str)
                else (_resolve(t["path"], base_dirs), float(t.get("weight", 1)))
                for t in train
            )
            values["eval_file"] = _resolve(data["eval"], base_dirs) if "eval" in data else None
            if "max_bad_rows" in data:
                values["max_bad_rows"] = data["max_bad_rows"]
        values["export_merge"] = bool(block.get("export", {}).get("merge", False))
        values["report_to"] = tuple(block.get("report_to", ()))
        lora = dict(block.get("lora", {}))
        if isinstance(lora.get("target_modules"), list):
            lora["target_modules"] = tuple(lora["target_modules"])
        values["lora"] = LoraConfig(**lora)
        values["checkpoint"] = CheckpointConfig(**block.get("checkpoint", {}))
        return cls(**values)

    def to_dict(self) -> dict:
        """Plain JSON-able form (written into checkpoints and env.json)."""
        out = asdict(self)
        out["train_sources"] = [list(t) for t in self.train_sources]
        out["report_to"] = list(self.report_to)
        if isinstance(self.lora.target_modules, tuple):
            out["lora"]["target_modules"] = list(self.lora.target_modules)
        return out

    @classmethod
    def from_saved(cls, saved: dict) -> TrainConfig:
        """Inverse of ``to_dict`` (paths are already absolute)."""
        values = dict(saved)
        values["train_sources"] = tuple(tuple(t) for t in values["train_sources"])
        values["report_to"] = tuple(values.get("report_to", ()))
        lora = dict(values.pop("lora"))
        if isinstance(lora.get("target_modules"), list):
            lora["target_modules"] = tuple(lora["target_modules"])
        return cls(lora=LoraConfig(**lora), checkpoint=CheckpointConfig(**values.pop("checkpoint")), **values)

    def with_changes(self, **changes: Any) -> TrainConfig:
        """A copy with some knobs changed (preset, OOM ladder)."""
        lora_r = changes.pop("lora_r", None)
        new = replace(self, **changes)
        if lora_r is not None:
            new = replace(new, lora=replace(new.lora, r=int(lora_r)))
        return new


def _round_three(block: dict, base_dirs: tuple[Path, ...]) -> dict:
    """init_from, chat_template, early_stopping, eval_samples and dpo as TrainConfig fields (paths resolved)."""
    out: dict = {}
    for key in ("init_from", "chat_template"):
        if key in block:
            out[key] = _resolve(block[key], base_dirs)
    if "early_stopping" in block:
        out["early_stopping_patience"] = block["early_stopping"]["patience"]
        out["early_stopping_min_delta"] = float(block["early_stopping"].get("min_delta", 0.0))
    if "eval_samples" in block:
        out["eval_samples_prompts"] = _resolve(block["eval_samples"]["prompts"], base_dirs)
        out["eval_samples_max_new_tokens"] = block["eval_samples"].get("max_new_tokens", 64)
    if "dpo" in block:
        out["dpo_beta"] = float(block["dpo"].get("beta", 0.1))
    return out


def _resolve(path: str, base_dirs: tuple[Path, ...]) -> str:
    """Absolute paths stay; a relative one takes the first base where it exists, else the first base."""
    expanded = Path(os.path.expanduser(path))
    if expanded.is_absolute():
        return str(expanded)
    candidates = [(base / expanded).resolve() for base in base_dirs] + [expanded.resolve()]
    return str(next((c for c in candidates if c.exists()), candidates[0]))


def load_validator() -> Draft202012Validator:
    """The train-block validator (built once per process by the caller)."""
    return Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


def _error_path(error: object) -> str:
    return ".".join(["train", *(str(p) for p in error.absolute_path)])  # type: ignore[attr-defined]


def _describe(error: object) -> str:
    """One readable message for a schema error; exclusive epochs/max_steps gets its own wording."""
    if error.validator == "oneOf" and not error.absolute_path:  # type: ignore[attr-defined]
        return "give exactly one of epochs or max_steps"
    return error.message  # type: ignore[attr-defined]


def validate_block(block: object, file: str) -> None:
    """Raise ConfigError (one line per problem) unless ``block`` matches train.schema.json."""
    if not isinstance(block, dict):
        raise ConfigError(f"{file}: train: expected a mapping of training knobs (see schemas/train.schema.json)")
    errors = sorted(load_validator().iter_errors(block), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError("\n".join(f"{file}: {_error_path(e)}: {_describe(e)}" for e in errors))


def read_job(job_dir: Path) -> tuple[dict, dict]:
    """Return (whole job mapping, its train: block) from ``job_dir/job.yaml``."""
    spec = job_dir / "job.yaml"
    try:
        text = spec.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{spec}: no job.yaml in this folder; python -m trainq.trainer JOB_DIR needs JOB_DIR/job.yaml"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{spec}: not UTF-8 text") from None
    try:
        job = load_yaml12(text)
    except YamlError as exc:
        raise ConfigError(f"{spec}: {exc}") from None
    if not isinstance(job, dict) or "train" not in job:
        raise ConfigError(f"{spec}: train: missing; this job has no train: block for the built-in trainer")
    return job, job["train"]


def base_dirs_for(job: dict, job_dir: Path) -> tuple[Path, ...]:
    """Where relative paths resolve, in order: the job's cwd, the folder it was submitted from, the job folder.

    The submitted-from folder (docs/contract.md) is job.yaml's ``submitted_from``, else the one the watcher
    recorded in run.json, else the queue root holding the job folder; a relative cwd resolves against it too.
    """
    base = _submitted_from(job, job_dir)
    bases = []
    cwd = job.get("cwd")
    if isinstance(cwd, str) and cwd:
        cwd = cwd.replace("{job_dir}", str(job_dir)).replace("{job_id}", job_dir.name)
        bases.append((base / os.path.expanduser(cwd)).resolve())
    bases += [base.resolve(), job_dir.resolve()]
    return tuple(dict.fromkeys(bases))


def _submitted_from(job: dict, job_dir: Path) -> Path:
    """job.yaml's ``submitted_from``, else run.json's, else the queue root holding a job folder
    (``ROOT/<state>/<id>``), else the folder itself (a job.yaml run by hand or previewed where it lies)."""
    given = job.get("submitted_from")
    if not isinstance(given, str) or not given:
        try:
            given = json.loads((job_dir / "run.json").read_text(encoding="utf-8")).get("submitted_from")
        except (OSError, ValueError, AttributeError):
            given = None
    if isinstance(given, str) and os.path.isabs(given):
        return Path(given)
    folder = job_dir.resolve()
    return folder.parent.parent if folder.parent.name in ("pending", "running", "done", "failed") else folder


def load_config(job_dir: Path) -> TrainConfig:
    """Read, validate and resolve the train: block of ``job_dir/job.yaml``; check that local paths exist."""
    job, block = read_job(job_dir)
    spec = str(job_dir / "job.yaml")
    validate_block(block, spec)
    config = TrainConfig.from_dict(block, base_dirs_for(job, job_dir))
    _check_paths(config, spec)
    return config


def _check_paths(config: TrainConfig, spec: str) -> None:
    if not Path(config.model).is_dir():
        raise ConfigError(
            f"{spec}: train.model: {config.model} is not a folder; give a local model folder (config, weights, tokenizer)"
        )
    if not (Path(config.model) / "config.json").is_file():
        raise ConfigError(
            f"{spec}: train.model: {config.model} has no config.json; give a folder saved by save_pretrained"
        )
    for index, (path, _weight) in enumerate(config.train_sources):
        field_name = "train.data" if config.eval_file is None and len(config.train_sources) == 1 else "train.data.train"
        if len(config.train_sources) > 1:
            field_name += f".{index}"
        if not Path(path).is_file():
            raise ConfigError(f"{spec}: {field_name}: {path} does not exist")
    if config.eval_file is not None and not Path(config.eval_file).is_file():
        raise ConfigError(f"{spec}: train.data.eval: {config.eval_file} does not exist")
    for knob, file in (
        ("train.chat_template", config.chat_template),
        ("train.eval_samples.prompts", config.eval_samples_prompts),
    ):
        if file is not None and not Path(file).is_file():
            raise ConfigError(f"{spec}: {knob}: {file} does not exist")
    if config.init_from is not None and not Path(config.init_from).is_dir():
        raise ConfigError(
            f"{spec}: train.init_from: {config.init_from} is not a folder; give a peft adapter folder or an "
            "HF checkpoint folder"
        )
    if config.early_stopping_patience is not None and config.eval_every is None:
        raise ConfigError(f"{spec}: train.early_stopping: needs eval_every (early stopping watches the eval loss)")
