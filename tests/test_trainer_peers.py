"""What the peers have, on the tiny model: early stopping with the best checkpoint restored, eval_samples into
samples.jsonl and status.html, chat_template, DoRA/rsLoRA, init_from (peft adapter, HF checkpoint) checked shape by
shape."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.trainer_util import adapter_tensors, build_tiny, events, output, records, run_trainer, summary, write_job
from trainq.trainer.config import ConfigError, TrainConfig
from trainq.watcher.faces.html import render_html
from trainq.watcher.faces.progress import MetricsTail
from trainq.watcher.spec.contract import EXIT_OK
from trainq.watcher.spec.units import iso_utc

#: a ChatML-like template over the tiny tokenizer's specials (a file the job names in chat_template)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow  # a full fine-tune until it overfits (~15 s on a quiet machine)
def test_early_stopping_restores_the_best_checkpoint_into_model(tiny, tmp_path):
    # one sentence learned by heart, evaluated on others: the eval loss falls, then rises as it overfits
    train = jsonl(tmp_path / "train.jsonl", [{"text": "zebra quartz yodel zebra quartz yodel."}] * 64)
    job = write_job(
        tmp_path / "job",
        tiny,
        method="full",
        lr=0.003,
        max_steps=80,
        eval_every=4,
        scheduler="constant",
        warmup_ratio=0.0,
        data={"train": str(train), "eval": str(tiny / "eval.jsonl")},
        checkpoint={"every_steps": 1000, "keep": 1},
        early_stopping={"patience": 2, "min_delta": 0.0},
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    done = summary(job)
    stop = done["early_stopping"]
    assert done["outcome"] == "done" and stop["stopped_at"] < 80 and done["steps"] == stop["stopped_at"]
    assert stop["stopped_at"] == done["best_step"] + 8, "two evals without improvement after the best"
    assert stop["restored"] == f"step-{done['best_step']:06d}" and events(job, "early_stop_restored")
    from safetensors.torch import load_file

    final = load_file(str(job / "model" / "model.safetensors"))
    best = load_file(str(job / "checkpoints" / stop["restored"] / "model.safetensors"))
    assert all(bool((final[k] == best[k]).all()) for k in best), "model/ holds the best checkpoint's weights"


def test_dora_rslora_chat_template_and_eval_samples(tiny, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    chats = [
        {"messages": [{"role": "user", "content": f"colour {i}?"}, {"role": "assistant", "content": "red."}]}
        for i in range(40)
    ]
    prompts = jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": "the red cat"}, {"messages": [{"role": "user", "content": "colour?"}]}]
    )
    job = write_job(
        tmp_path / "job",
        tiny,
        max_steps=8,
        eval_every=4,
        data={"train": str(jsonl(tmp_path / "c.jsonl", chats))},
        eval_fraction=0.1,
        lora={"r": 4, "dora": True, "rslora": True},
        chat_template=str(template),
        eval_samples={"prompts": str(prompts), "max_new_tokens": 5},
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    config = json.loads((job / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    assert any("lora_magnitude_vector" in k for k in adapter_tensors(job / "adapter"))
    saved = json.loads((job / "adapter" / "tokenizer_config.json").read_text())
    assert saved.get("chat_template") == TEMPLATE or (job / "adapter" / "chat_template.jinja").read_text() == TEMPLATE

    samples = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (4, "the red cat"),
        (4, "colour?"),
        (8, "the red cat"),
        (8, "colour?"),
    ]
    assert all(isinstance(s["completion"], str) for s in samples)
    tail = MetricsTail(job / "metrics.jsonl")
    tail.poll()
    shown = tail.progress["samples"]
    assert shown[0]["prompt"] == "the red cat" and shown[0]["completion"] == samples[2]["completion"]
    page = render_html(
        {
            "schema_version": 1,
            "watcher": {"heartbeat_at": iso_utc(time.time())},
            "jobs": [
                {"id": "j", "name": "j", "state": "running", "progress": {**tail.progress, "warning": "a <plateau>"}}
            ],
        },
        {},
    )
    assert "sample generations" in page and "the red cat" in page and "a &lt;plateau&gt;" in page


def test_init_from_takes_an_adapter_or_a_checkpoint_shape_by_shape(tiny, tmp_path):
    import torch
    from peft import get_peft_model_state_dict

    from trainq.trainer import init_from
    from trainq.trainer.modeling import build_model, resolve_precision

    job = write_job(tmp_path / "src", tiny, max_steps=4, eval_every=None, lora={"r": 4})
    assert run_trainer(job) == EXIT_OK, output(job)
    config = TrainConfig.from_dict(
        {"model": str(tiny / "model"), "data": str(tiny / "train.jsonl"), "max_steps": 1, "lora": {"r": 4}}, (tmp_path,)
    )
    model = build_model(config, resolve_precision("fp32"))
    assert init_from.load(model, job / "adapter", "lora")[0] == "adapter"
    given = adapter_tensors(job / "adapter")
    assert all(torch.equal(get_peft_model_state_dict(model)[k], given[k]) for k in given)
    with pytest.raises(ConfigError, match=r"lora_A.weight has shape \(4, \d+\), this model's is \(8, \d+\)"):
        init_from.load(build_model(config.with_changes(lora_r=8), resolve_precision("fp32")), job / "adapter", "lora")

    base = build_model(config, resolve_precision("fp32"))  # an HF checkpoint under a fresh adapter: the frozen base
    kind, count = init_from.load(base, tiny / "model", "lora")
    assert kind == "model" and count == len(
        [n for n, _ in base.get_base_model().named_parameters() if "lora_" not in n]
    )
    with pytest.raises(ConfigError, match="holds no weights"):
        init_from.load(base, tmp_path, "lora")

    forked = write_job(
        tmp_path / "fork", tiny, max_steps=2, eval_every=None, lora={"r": 4}, init_from=str(job / "adapter")
    )
    assert run_trainer(forked) == EXIT_OK, output(forked)
    assert events(forked, "init_from")[0]["kind"] == "adapter"
    assert records(forked, "step")[0]["loss"] == pytest.approx(records(job, "step")[-1]["loss"], abs=0.3)
