"""Loss on the right tokens: chat templates with and without {% generation %}, the plain fallback, unmaskable
templates, alpaca/ShareGPT rows, and a real full fine-tune that can (assistant) or cannot (all) reach ~0 loss."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, output, records, run_trainer, summary, write_job
from trainq.trainer.chat import IGNORE_INDEX, masking_method
from trainq.trainer.data import DataError, Row, encode, read_rows
from trainq.watcher.spec.contract import EXIT_DATA, EXIT_OK

#: a ChatML-like template over the tiny tokenizer's own specials, assistant turns marked with {% generation %}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
#: the same rendering without the tags: masked by the prefix-by-prefix fallback
UNTAGGED = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
#: a header that counts the turns: a prefix does not render as a prefix, so nothing can be masked
UNMASKABLE = "{{ messages | length }} turns\n" + UNTAGGED
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the dog"},
    {"role": "assistant", "content": "is brown."},
    {"role": "user", "content": "and the cat"},
    {"role": "assistant", "content": "is grey."},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def model_with_template(tiny: Path, dest: Path, template: str | None) -> Path:
    """A copy of the tiny model folder whose tokenizer carries ``template``."""
    from trainq.trainer.modeling import load_tokenizer

    shutil.copytree(tiny / "model", dest)
    tokenizer = load_tokenizer(str(dest))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(dest))
    return dest


def tokenizer_with(template: str | None, tiny: Path):
    from trainq.trainer.modeling import load_tokenizer

    tokenizer = load_tokenizer(str(tiny / "model"))
    tokenizer.chat_template = template
    return tokenizer


def trained_text(example: dict, tokenizer) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])


def row(record: dict, kind: str = "messages") -> Row:
    return Row("data.jsonl", 7, kind, record, "0" * 64)


def test_generation_tags_and_prefix_fallback_mask_the_same_tokens(tiny):
    tagged, untagged = tokenizer_with(TEMPLATE, tiny), tokenizer_with(UNTAGGED, tiny)
    assert masking_method(tagged) == "generation" and masking_method(untagged) == "prefix"
    a = encode(row({"messages": CONVERSATION}), tagged, 256)
    b = encode(row({"messages": CONVERSATION}), untagged, 256)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
    assert trained_text(a, tagged) == "is brown.<|eos|>is grey.<|eos|>"
    assert a["input_ids"].count(tagged.bos_token_id) == 1, "a template that writes bos_token must not get a second one"
    everything = encode(row({"messages": CONVERSATION}), tagged, 256, train_on="all")
    assert everything["labels"] == everything["input_ids"] == a["input_ids"]


def test_a_template_that_cannot_be_masked_is_a_data_error_naming_the_row(tiny):
    tokenizer = tokenizer_with(UNMASKABLE, tiny)
    with pytest.raises(
        DataError, match=r"data\.jsonl: line 7: train\.train_on: .*prefix by prefix.*train_on: all"
    ) as info:
        encode(row({"messages": CONVERSATION}), tokenizer, 256)
    assert info.value.exit_code == EXIT_DATA
    assert encode(row({"messages": CONVERSATION}), tokenizer, 256, train_on="all")["labels"][0] != IGNORE_INDEX


def test_alpaca_and_sharegpt_rows_are_conversations(tiny, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"instruction": "name a colour", "input": "", "output": "red."},
                {"instruction": "repeat", "input": "the fox", "output": "the fox."},
                {"conversations": [{"from": "human", "value": "the dog"}, {"from": "gpt", "value": "is brown."}]},
                {"conversations": [{"from": "robot", "value": "x"}]},
                {"instruction": "no output"},
            ]
        )
        + "\n"
    )
    rows, bad = read_rows(str(path))
    assert [r.kind for r in rows] == ["alpaca", "alpaca", "sharegpt"] and [b.line for b in bad] == [4, 5]
    tokenizer = tokenizer_with(TEMPLATE, tiny)
    assert trained_text(encode(rows[1], tokenizer, 256), tokenizer) == "the fox.<|eos|>"
    sharegpt = encode(rows[2], tokenizer, 256)
    assert sharegpt == encode(row({"messages": CONVERSATION[1:3]}), tokenizer, 256)


def chat_rows(count: int, seed: int = 7) -> list[dict]:
    """Random user turns, one constant assistant answer."""
    rng = random.Random(seed)
    words = [
        "red",
        "blue",
        "green",
        "cat",
        "dog",
        "fox",
        "bird",
        "hill",
        "tree",
        "barn",
        "river",
        "fence",
        "old",
        "small",
        "runs",
        "sits",
        "looks",
        "walks",
    ]
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(12, 16)))},
                {"role": "assistant", "content": "the red cat sits on the fence."},
            ]
        }
        for _ in range(count)
    ]


def test_assistant_only_loss_learns_the_constant_answer_and_all_tokens_cannot(tiny, tmp_path):
    model = model_with_template(tiny, tmp_path / "model", TEMPLATE)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(160)))
    final = {}
    for train_on in ("assistant", "all"):
        job = write_job(
            tmp_path / train_on,
            tiny,
            method="full",
            lr=0.002,
            max_steps=100,
            batch_size=8,
            seq_len=64,
            eval_every=None,
            checkpoint={"every_steps": 1000},
            log_every=50,
            train_on=train_on,
            data={"train": str(data)},
            eval_fraction=0,
            model=str(model),
        )
        assert run_trainer(job) == EXIT_OK, output(job)
        losses = [r["loss"] for r in records(job, "step")]
        final[train_on] = sum(losses[-10:]) / 10
        assert summary(job)["train_on"] == train_on
    print(f"mean loss of the last 10 steps: {final}")
    assert final["assistant"] < 0.2, "the constant answer is learnable: loss on assistant tokens falls near zero"
    assert final["all"] > max(1.0, 5 * final["assistant"]), "random user turns keep the loss on all tokens high"
