"""A plain Hugging Face Trainer script with no trainq code (unless --trainq adds the one-line callback).

Full fine-tuning of the tiny model; every standard TrainingArguments flag works (--output_dir,
--max_steps, --save_steps, --resume_from_checkpoint, ...). --step_sleep_s paces steps so a test can
stop it mid-run; --save_weights FILE writes the final weights for a bitwise comparison.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class ScriptArgs:
    model: str
    data: str
    seq_len: int = 32
    step_sleep_s: float = 0.0
    save_weights: str = ""
    trainq: bool = False


class Rows(torch.utils.data.Dataset):
    def __init__(self, path: str, tokenizer, seq_len: int) -> None:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        self.enc = tokenizer(texts, max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt")

    def __len__(self) -> int:
        return self.enc["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.enc["input_ids"][i], self.enc["attention_mask"][i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Pace(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main() -> None:
    script, args = HfArgumentParser((ScriptArgs, TrainingArguments)).parse_args_into_dataclasses()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    model = AutoModelForCausalLM.from_pretrained(script.model)
    callbacks = [Pace(script.step_sleep_s)] if script.step_sleep_s else []
    if script.trainq:
        from trainq.trainer.integrations import TrainqCallback

        callbacks.append(TrainqCallback())
    trainer = Trainer(
        model=model, args=args, train_dataset=Rows(script.data, tokenizer, script.seq_len), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if script.save_weights and trainer.state.global_step >= args.max_steps:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, script.save_weights)
    print(f"final global_step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
