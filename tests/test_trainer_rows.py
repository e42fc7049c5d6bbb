"""Data that never crashes a job: every per-row problem is a bad row (line, reason, category) counted against
max_bad_rows; an empty set after filtering is diagnosis data with counts per reason; role names, the OpenAI/HF
tool-call shape, and the end-of-turn token after every assistant turn without a template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer_util import build_tiny, events, output, run_trainer, summary, write_job
from trainq.trainer.chat import IGNORE_INDEX
from trainq.trainer.data import ROLE_NAMES, DataError, Row, RowError, encode, read_rows, tokenize
from trainq.watcher.spec.contract import EXIT_DATA, EXIT_OK

#: a Mistral-style template: refuses a conversation whose turns do not alternate user/assistant
STRICT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<' + m['role'] + '>' + m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
#: counts the turns in a header: renderings are not prefixes of each other, so assistant tokens cannot be found
UNMASKABLE = "{{ messages | length }} turns\n" + STRICT.split("{% for")[0] + "{% for" + STRICT.split("{% for", 1)[1]
TOOL_CALL = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from trainq.trainer.modeling import load_tokenizer

    return load_tokenizer(str(tiny / "model"))


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(user: str, answer: str, user_role: str = "user", bot_role: str = "assistant") -> dict:
    return {"messages": [{"role": user_role, "content": user}, {"role": bot_role, "content": answer}]}


def trained(example: dict, tokenizer) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])


def test_documented_role_names_map_and_unknown_roles_are_bad_rows_by_line(tmp_path):
    path = write_rows(
        tmp_path / "d.jsonl",
        [
            chat("hi", "yo", "human", "gpt"),
            chat("hi", "yo", "user", "bot"),
            chat("hi", "yo", "user", "model"),
            chat("hi", "yo", "user", "robot"),
            {"conversations": [{"from": "human", "value": "a"}, {"from": "droid", "value": "b"}]},
            "{not json",
        ],
    )
    rows, bad = read_rows(str(path))
    assert [r.line for r in rows] == [1, 2, 3]
    assert [(b.line, b.category) for b in bad] == [(4, "role"), (5, "role"), (6, "json")]
    assert "unknown role 'robot'" in bad[0].reason and "bot" in bad[0].reason, "the reason lists the known names"
    assert {ROLE_NAMES[n] for n in ("human", "gpt", "bot", "model")} == {"user", "assistant"}


def test_each_row_problem_is_a_row_error_naming_line_and_reason(tiny, tokenizer, tmp_path):
    def problem(record: dict, seq_len: int = 64, template: str | None = None) -> RowError:
        tokenizer.chat_template = template
        try:
            with pytest.raises(RowError) as info:
                encode(
                    Row("d.jsonl", 9, "messages" if "messages" in record else "prompt", record, "0" * 64),
                    tokenizer,
                    seq_len,
                )
        finally:
            tokenizer.chat_template = None
        assert str(info.value).startswith("d.jsonl: line 9: ") and isinstance(info.value, DataError)
        return info.value

    assert problem({"messages": [{"role": "user", "content": "only a question"}]}).bad.category == "no_assistant"
    system_first = {"messages": [{"role": "system", "content": "be brief"}, *chat("hi", "yo")["messages"]]}
    error = problem(system_first, template=STRICT)
    assert error.bad.category == "template" and "roles must alternate" in error.bad.reason
    assert problem(chat("hi", "yo"), template=UNMASKABLE).bad.category == "unmaskable"
    assert problem({"prompt": "word " * 200, "completion": "x"}, seq_len=64).bad.category == "truncated"
    assert problem({"prompt": "the red cat " * 25, "completion": "x"}, seq_len=64).bad.category == "no_trained_tokens"


def test_tool_call_rows_are_accepted_and_every_assistant_turn_ends_with_eos(tokenizer, tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"messages": TOOL_CALL}])
    rows, bad = read_rows(str(path))
    assert not bad and rows[0].kind == "messages"
    example = encode(rows[0], tokenizer, 256)
    text = trained(example, tokenizer)
    assert "get_weather" in text and "Paris" in text and "It is sunny." in text and "sunny" + "<|eos|>" not in text[:20]
    assert example["input_ids"].count(tokenizer.eos_token_id) == 2, "each assistant turn ends with eos (no template)"
    eos_labels = [
        label for t, label in zip(example["input_ids"], example["labels"], strict=False) if t == tokenizer.eos_token_id
    ]
    assert eos_labels == [tokenizer.eos_token_id] * 2, "both end-of-turn tokens are trained"
    ends_on_user = encode(
        Row(
            "d",
            1,
            "messages",
            {"messages": [*TOOL_CALL[:1], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}]},
            "",
        ),
        tokenizer,
        64,
    )
    assert ends_on_user["labels"][-1] == IGNORE_INDEX and ends_on_user["input_ids"][-1] == tokenizer.eos_token_id


def test_tokenize_collects_bad_rows_once_per_line_instead_of_raising(tokenizer):
    rows = [
        Row("d", 1, "messages", chat("hi", "yo"), ""),
        Row("d", 2, "messages", {"messages": [{"role": "user", "content": "q"}]}, ""),
    ]
    dataset = tokenize(rows * 2, tokenizer, 64)  # a weight-2 file repeats its rows
    assert len(dataset) == 2 and [(b.line, b.category) for b in dataset.bad] == [(2, "no_assistant")]


def test_a_job_whose_rows_all_fail_is_a_data_error_with_counts_and_a_few_bad_ones_train(tiny, tmp_path):
    good = [chat(f"say {i}", "the red cat sits.") for i in range(40)]
    bad = [{"messages": [{"role": "user", "content": "no answer"}]}] * 2 + [chat("a", "b", "user", "robot")]
    mixed = write_rows(tmp_path / "mixed.jsonl", good + bad)
    job = write_job(
        tmp_path / "mixed",
        tiny,
        data={"train": str(mixed), "max_bad_rows": 3},
        max_steps=2,
        eval_every=None,
        checkpoint={"every_steps": 100},
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    found = events(job, "bad_rows")
    assert [e["stage"] for e in found] == ["reading", "tokenizing"]
    assert found[1]["reasons"] == {"no assistant turn": 2} and summary(job)["outcome"] == "done"

    empty = write_rows(tmp_path / "empty.jsonl", [*bad, {"prompt": "word " * 200, "completion": "x"}])
    job = write_job(tmp_path / "empty", tiny, data={"train": str(empty), "max_bad_rows": 10}, max_steps=2)
    assert run_trainer(job) == EXIT_DATA, output(job)
    log = output(job)
    assert "Traceback" not in log and "RandomSampler" not in log
    assert (
        "no usable training row after filtering (4 bad: 2 no assistant turn, 1 unknown role, 1 cut by more than "
        "half at seq_len)" in log
    ), log[-800:]
