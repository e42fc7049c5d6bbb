"""``eval_samples: {prompts: FILE, max_new_tokens: N}``: at each eval, a greedy generation for every prompt of FILE,
appended to ``samples.jsonl`` (one ``{step, prompt, completion}`` line each) and summarised in an ``eval_samples``
event (the first MAX_SHOWN, cut to MAX_SHOWN_CHARS) that the watcher shows in status.json and status.html.

Greedy decoding draws no random numbers, so sampling at evals leaves exact resume intact. Prompt rows are
``{"prompt": TEXT}`` (encoded as training encodes a prompt: bos + text) or ``{"messages": [...]}`` (the chat
template with its generation prompt, else ``role: content`` lines ending in ``assistant: ``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from trainq.trainer.config import ConfigError

SAMPLES_FILE = "samples.jsonl"
#: generations carried in the event (and so in status.json / status.html), each cut to MAX_SHOWN_CHARS
MAX_SHOWN = 3
MAX_SHOWN_CHARS = 200


def read_prompts(path: str) -> list[dict]:
    """The prompt rows; ConfigError naming the file and line for a row that is neither shape."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"train.eval_samples.prompts: {path}: line {number}: not valid JSON") from None
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
        ):
            raise ConfigError(f"train.eval_samples.prompts: {path}: line {number}: needs prompt (a string) or messages")
        prompts.append(row)
    if not prompts:
        raise ConfigError(f"train.eval_samples.prompts: {path}: no prompt rows")
    return prompts


def prompt_ids(row: dict, tokenizer) -> list[int]:
    """Token ids the model continues from."""
    if "prompt" in row:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    text = "\n".join(f"{m['role']}: {m['content']}" for m in row["messages"]) + "\nassistant: "
    return bos + tokenizer(text, add_special_tokens=False)["input_ids"]


def _label(row: dict) -> str:
    return row["prompt"] if "prompt" in row else row["messages"][-1].get("content", "")


class EvalSamples(TrainerCallback):
    """Greedy generations at each eval into samples.jsonl and an ``eval_samples`` event."""

    def __init__(self, run, config, tokenizer, job_dir: Path):
        self.run = run
        self.tokenizer = tokenizer
        self.max_new_tokens = config.eval_samples_max_new_tokens
        self.prompts = read_prompts(config.eval_samples_prompts)
        self.path = job_dir / SAMPLES_FILE
        self.trainer = None

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        samples = [
            {
                "step": state.global_step,
                "prompt": _label(row),
                "completion": self._generate(model, row),
                "time": time.time(),
            }
            for row in self.prompts
        ]
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(s, ensure_ascii=False) + "\n" for s in samples)
        shown = [
            {"prompt": s["prompt"][:MAX_SHOWN_CHARS], "completion": s["completion"][:MAX_SHOWN_CHARS]}
            for s in samples[:MAX_SHOWN]
        ]
        self.run.metrics.event(
            "eval_samples",
            f"step {state.global_step}: {len(samples)} sample generations in {SAMPLES_FILE}",
            step=state.global_step,
            samples=shown,
        )

    @torch.no_grad()
    def _generate(self, model, row: dict) -> str:
        was_training = model.training
        model.eval()
        ids = torch.tensor([prompt_ids(row, self.tokenizer)], device=next(model.parameters()).device)
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        finally:
            model.train(was_training)
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
