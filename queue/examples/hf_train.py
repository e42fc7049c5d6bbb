"""A plain Hugging Face Trainer script, as users already have them: trainq needs no code in it.

Run it as a command job (hf-trainer.yaml beside it). trainq finds the `checkpoint-N` folders the
Trainer writes under --output_dir, passes the newest complete one back through resume_args, and
reads progress (step/total, loss, ETA) from what the Trainer prints.

    python hf_train.py --model DIR/model --data DIR/train.jsonl --output_dir OUT --max_steps 40 --save_steps 10
    python hf_train.py ... --trainq      # the optional one-line integration (clean stop on stop.flag)

`python -m trainq.trainer.tiny DIR` builds a tiny model and data to try it on (seconds, CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class ScriptArgs:
    model: str = field(metadata={"help": "a local model folder"})
    data: str = field(metadata={"help": 'a JSONL file of {"text": ...} rows'})
    seq_len: int = 48
    trainq: bool = field(default=False, metadata={"help": "add trainq's TrainerCallback"})


class TextRows(torch.utils.data.Dataset):
    """Tokenized rows, padded to seq_len; labels are the inputs (causal LM), padding ignored."""

    def __init__(self, path: str, tokenizer, seq_len: int) -> None:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        self.enc = tokenizer(texts, max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt")

    def __len__(self) -> int:
        return self.enc["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.enc["input_ids"][i], self.enc["attention_mask"][i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    script, args = HfArgumentParser((ScriptArgs, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    model = AutoModelForCausalLM.from_pretrained(script.model)
    callbacks = []
    if script.trainq:
        from trainq.trainer.integrations import TrainqCallback  # the one line trainq asks for

        callbacks.append(TrainqCallback())
    trainer = Trainer(
        model=model, args=args, train_dataset=TextRows(script.data, tokenizer, script.seq_len), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(f"{args.output_dir}/final")


if __name__ == "__main__":
    main()
