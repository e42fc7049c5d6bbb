"""Build a tiny random-weight causal LM, its tokenizer and learnable data, offline and byte-identical.

Usage: ``python -m trainq.trainer.tiny DIR [--size tiny|small|medium]`` writes ``DIR/model/`` (Llama config, safetensors
weights, a byte-level BPE tokenizer trained here), ``DIR/train.jsonl`` and ``DIR/eval.jsonl``, then prints the paths.
``tiny`` (~0.2M params) is for tests; ``small`` (a few million) and ``medium`` (~26 M) for benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

#: seed for weights and data: rebuilding gives the same bytes
SEED = 1234
#: special tokens of the tiny tokenizer
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

_COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "grey"]
_ANIMALS = ["cat", "dog", "fox", "bird", "horse", "mouse", "goat", "bear"]
_VERBS = ["jumps over", "runs past", "sleeps near", "looks at", "walks to", "sits on"]
_THINGS = ["the fence", "the river", "the old tree", "the red barn", "the hill", "the small house"]


@dataclass(frozen=True)
class TinySize:
    """Shape of one tiny model."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    train_rows: int
    eval_rows: int


SIZES = {
    "tiny": TinySize(hidden=64, layers=2, heads=4, intermediate=128, vocab=1000, train_rows=400, eval_rows=48),
    "small": TinySize(hidden=256, layers=4, heads=8, intermediate=688, vocab=2000, train_rows=2000, eval_rows=100),
    # >= 20 M parameters (issue 37's bar for the loop and vitals benchmarks): ~26 M, built in seconds like the others
    "medium": TinySize(hidden=512, layers=8, heads=8, intermediate=1376, vocab=2000, train_rows=2000, eval_rows=100),
}


def sentence(rng: random.Random) -> str:
    """One templated, learnable sentence."""
    color, animal = rng.choice(_COLORS), rng.choice(_ANIMALS)
    return f"the {color} {animal} {rng.choice(_VERBS)} {rng.choice(_THINGS)} and the {animal} is {color}."


def make_rows(count: int, rng: random.Random) -> list[dict]:
    """Rows of one or two sentences as ``{"text": ...}``."""
    return [{"text": " ".join(sentence(rng) for _ in range(rng.randint(1, 2)))} for _ in range(count)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, stable key order."""
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def train_tokenizer(corpus: list[str], vocab: int):
    """A byte-level BPE tokenizer trained on ``corpus`` (deterministic), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def build_model(size: TinySize, vocab: int):
    """A randomly initialised LlamaForCausalLM (fixed seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def build(out_dir: Path, size_name: str = "tiny") -> dict[str, Path]:
    """Write model/, train.jsonl and eval.jsonl under ``out_dir``; return their paths."""
    size = SIZES[size_name]
    rng = random.Random(SEED)
    train_rows, eval_rows = make_rows(size.train_rows, rng), make_rows(size.eval_rows, rng)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / "model"
    tokenizer = train_tokenizer([r["text"] for r in train_rows], size.vocab)
    model = build_model(size, len(tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for path in model_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600
    paths = {"model": model_dir, "train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl"}
    write_jsonl(paths["train"], train_rows)
    write_jsonl(paths["eval"], eval_rows)
    return paths


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build and print the paths."""
    parser = argparse.ArgumentParser(
        prog=os.environ.get("TRAINQ_PROG") or "python -m trainq.trainer.tiny", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dir", type=Path, help="output folder (created)")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny for tests, small and medium (>= 20 M parameters) for benchmarks",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name, path in build(args.dir, args.size).items():
        print(f"{name}: {path.resolve()}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # skip the ~1.3 s interpreter shutdown of torch
