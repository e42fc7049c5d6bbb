"""Plain unit tests of the trainer's pieces: memory presets, OOM ladder, faults, data formats, config, checkpoint files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainq.trainer import checkpoints, ladder
from trainq.trainer.config import ConfigError, load_config
from trainq.trainer.data import IGNORE_INDEX, DataError, Row, RowError, encode, read_rows, split
from trainq.trainer.faults import FaultSpecError, parse_faults
from trainq.trainer.presets import Knobs, ModelShape, PresetError, choose, estimate
from trainq.trainer.sources import load_data

# Published shapes (config.json of each model family)
QWEN25_05B = ModelShape(hidden=896, layers=24, intermediate=4864, vocab=151936, heads=14, kv_heads=2, tied=True)
QWEN25_15B = ModelShape(hidden=1536, layers=28, intermediate=8960, vocab=151936, heads=12, kv_heads=2, tied=True)
LLAMA2_7B = ModelShape(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32, kv_heads=32, tied=False)
GB6 = 6144


# -- presets -------------------------------------------------------------------------------------------------


def test_parameter_counts_match_published_sizes():
    assert abs(QWEN25_05B.params / 1e9 - 0.494) < 0.01
    assert abs(QWEN25_15B.params / 1e9 - 1.54) < 0.02
    assert abs(LLAMA2_7B.params / 1e9 - 6.74) < 0.02


@pytest.mark.parametrize("shape", [QWEN25_05B, QWEN25_15B], ids=["0.5B", "1.5B"])
def test_small_models_fit_qlora_in_6gb(shape):
    choice = choose(shape, "qlora", Knobs(seq_len=1024, batch_size=4, grad_accum=4, lora_r=16), GB6)
    assert choice.estimate.total_mb <= 0.85 * GB6
    assert choice.knobs.effective_batch == 16, "the preset keeps the effective batch"


def test_7b_qlora_does_not_fit_6gb_and_says_why():
    with pytest.raises(PresetError, match=r"nothing fits.*MiB"):
        choose(LLAMA2_7B, "qlora", Knobs(1024, 4, 4, 16), GB6)


def test_7b_qlora_fits_24gb_and_grows_the_micro_batch():
    choice = choose(LLAMA2_7B, "qlora", Knobs(1024, 1, 16, 16), 24 * 1024)
    assert choice.knobs.batch_size > 1 and choice.knobs.effective_batch == 16 and choice.knobs.seq_len == 1024


def test_estimate_orders_methods_and_matches_the_7b_rules_of_thumb():
    knobs = Knobs(512, 1, 1, 16)
    q, lo, f = (estimate(LLAMA2_7B, m, knobs).total_mb for m in ("qlora", "lora", "full"))
    assert q < lo < f
    assert 12_000 < lo < 24_000, "7B LoRA in 16-bit: ~16 GB class"
    assert f > 100_000, "7B full fine-tune with Adam: ~120 GB class"


def test_shrinks_batch_before_sequence_before_rank():
    tight = choose(QWEN25_15B, "qlora", Knobs(2048, 8, 1, 16), GB6)
    assert tight.knobs.lora_r == 16
    assert tight.knobs.batch_size < 8 and tight.knobs.effective_batch == 8


def test_model_shape_reads_config_json_keys():
    shape = ModelShape.from_config(
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 1000,
            "num_attention_heads": 4,
        }
    )
    assert shape.kv_heads == 4 and not shape.tied and shape.lora_params(8) == 2 * 8 * (4 * 128 + 2 * 192 + 192)


# -- OOM ladder ----------------------------------------------------------------------------------------------


def _oom(attempt, batch, accum, seq=512):
    return {
        "type": "event",
        "event": "oom",
        "attempt": attempt,
        "batch_size": batch,
        "grad_accum": accum,
        "seq_len": seq,
        "lora_r": 16,
    }


def test_ladder_halves_batch_then_sequence():
    knobs, rung = ladder.plan([_oom(1, 8, 1)], attempt=2)
    assert (knobs["batch_size"], knobs["grad_accum"], rung.change) == (4, 2, "batch_size 8 -> 4, grad_accum 1 -> 2")
    knobs, rung = ladder.plan([_oom(1, 1, 16, 512)], attempt=2)
    assert knobs["seq_len"] == 256 and knobs["batch_size"] == 1


def test_ladder_keeps_an_applied_rung_and_ignores_later_attempts():
    applied = {
        "type": "event",
        "event": "oom_ladder",
        "attempt": 2,
        "to": {"batch_size": 4, "grad_accum": 2, "seq_len": 512, "lora_r": 16},
    }
    knobs, rung = ladder.plan([_oom(1, 8, 1), applied], attempt=3)
    assert rung is None and knobs["batch_size"] == 4
    assert ladder.plan([_oom(2, 8, 1)], attempt=2) is None
    assert ladder.plan([], attempt=2) is None


# -- faults --------------------------------------------------------------------------------------------------


def test_fault_switch_parses_lists_and_refuses_unknown_keys():
    faults = parse_faults("nan_at=5,6,7,sleep_per_step=0.2,oom_at=3,spike_at=12")
    assert (
        faults.nan_at == {5, 6, 7} and faults.sleep_per_step == 0.2 and faults.oom_at == {3} and faults.spike_at == {12}
    )
    assert parse_faults(None) == parse_faults("")
    with pytest.raises(FaultSpecError, match="unknown fault"):
        parse_faults("explode_at=3")
    with pytest.raises(FaultSpecError, match="not a number"):
        parse_faults("stop_at=x")


# -- data ----------------------------------------------------------------------------------------------------


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_rows_of_every_format_and_bad_rows_with_line_numbers(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"text": "hello"}),
            "{not json",
            json.dumps({"prompt": "q", "completion": "a"}),
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
            json.dumps({"text": ""}),
            json.dumps(["a list"]),
            json.dumps({"messages": [{"role": "user"}]}),
        ],
    )
    rows, bad = read_rows(path)
    assert [(r.kind, r.line) for r in rows] == [("text", 1), ("prompt", 3), ("messages", 4)]
    assert [b.line for b in bad] == [2, 5, 6, 7]
    assert str(bad[0]).startswith(f"{path}: line 2: not valid JSON")


def test_no_usable_row_fails_naming_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"txt": "typo"}), json.dumps({"text": 3})])
    with pytest.raises(DataError, match=r"d\.jsonl: line 1: no text") as info:
        load_data(path, None, 0.1)
    assert info.value.exit_code == 65
    with pytest.raises(DataError, match="empty"):
        load_data(_jsonl(tmp_path / "e.jsonl", []), None, 0.1)


def test_held_out_split_is_deterministic_and_never_leaks(tmp_path):
    lines = [json.dumps({"text": f"row {i % 150}"}) for i in range(300)]  # every record appears twice
    rows, _ = read_rows(_jsonl(tmp_path / "d.jsonl", lines))
    train, held = split(rows, 0.2)
    assert 20 < len(held) < 100
    assert {r.digest for r in train}.isdisjoint({r.digest for r in held})
    assert [r.line for r in split(rows, 0.2)[1]] == [r.line for r in held]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.trainer_util import build_tiny
    from trainq.trainer.modeling import load_tokenizer

    return load_tokenizer(str(build_tiny(tmp_path_factory.mktemp("tiny")) / "model"))


def test_prompt_tokens_are_masked_out_of_the_loss(tokenizer):
    row = Row("f", 1, "prompt", {"prompt": "the red cat", "completion": " is red."}, "0" * 64)
    example = encode(row, tokenizer, seq_len=64)
    prompt_len = 1 + len(tokenizer("the red cat", add_special_tokens=False)["input_ids"])
    assert example["labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert example["labels"][prompt_len:] == example["input_ids"][prompt_len:]
    assert example["input_ids"][-1] == tokenizer.eos_token_id


def test_messages_without_template_train_on_assistant_contents_only(tokenizer):
    messages = [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "is brown."}]
    row = Row("f", 1, "messages", {"messages": messages}, "0" * 64)
    example = encode(row, tokenizer, seq_len=64)
    kept = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(kept).strip() == "is brown." + tokenizer.eos_token  # the token " is" carries the space
    assert encode(row, tokenizer, seq_len=64, train_on="all")["labels"] == example["input_ids"]
    whole = len(example["input_ids"])
    assert len(encode(row, tokenizer, seq_len=whole - 2)["input_ids"]) == whole - 2, "a little over seq_len: truncated"
    with pytest.raises(RowError, match=r"more than half would be cut at seq_len 4") as info:  # round three: a bad row
        encode(row, tokenizer, seq_len=4)
    assert info.value.bad.category == "truncated"


# -- config --------------------------------------------------------------------------------------------------


def _job(tmp_path: Path, train: dict, extra: str = "") -> Path:
    (tmp_path / "job.yaml").write_text("approved: true\n" + extra + "train: " + json.dumps(train) + "\n")
    return tmp_path


def test_config_resolves_relative_paths_against_the_job_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text("")
    config = load_config(_job(tmp_path, {"model": "m", "data": "d.jsonl", "epochs": 1}))
    assert config.model == str(tmp_path / "m") and config.lora.r == 16 and config.lora.dropout == 0.05
    assert config.to_dict()["lora"]["target_modules"] == "all-linear"


def test_config_errors_are_one_line_naming_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match=r"job\.yaml: train\.model: .*nope is not a folder") as info:
        load_config(_job(tmp_path, {"model": "nope", "data": "d.jsonl", "max_steps": 3}))
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="exactly one of epochs or max_steps"):
        load_config(_job(tmp_path, {"model": "m", "data": "d", "max_steps": 3, "epochs": 1}))
    with pytest.raises(ConfigError, match=r"train\.lora\.r: -4 is less than the minimum"):
        load_config(_job(tmp_path, {"model": "m", "data": "d", "max_steps": 3, "lora": {"r": -4}}))


# -- checkpoint files ----------------------------------------------------------------------------------------


def _fake_checkpoint(ckpt_dir: Path, step: int, complete: bool = True) -> Path:
    tmp = checkpoints.begin(ckpt_dir, step)
    (tmp / "adapter_model.safetensors").write_bytes(os.urandom(64))
    (tmp / checkpoints.STATE_FILE).write_text("{}")
    return checkpoints.publish(tmp) if complete else tmp


def test_newest_complete_skips_damaged_and_unsealed(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_checkpoint(ckpts, step)
    checkpoints.point_link(ckpts, "ckpt_latest", ckpts / "step-000006")
    (ckpts / "step-000006" / "adapter_model.safetensors").write_bytes(b"torn")
    _fake_checkpoint(ckpts, 8, complete=False)
    assert checkpoints.resolve_resume(ckpts / "ckpt_latest").name == "step-000004"
    with pytest.raises(checkpoints.CheckpointError, match="wrong size"):
        checkpoints.resolve_resume(ckpts / "step-000006")


def test_rotation_never_deletes_link_targets(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        _fake_checkpoint(ckpts, step)
    checkpoints.point_link(ckpts, "ckpt_best", ckpts / "step-000001")
    checkpoints.point_link(ckpts, "ckpt_latest", ckpts / "step-000005")
    checkpoints.rotate(ckpts, keep=2)
    assert sorted(p.name for p in ckpts.iterdir() if not p.is_symlink()) == [
        "step-000001",
        "step-000004",
        "step-000005",
    ]
    assert os.readlink(ckpts / "ckpt_best") == "step-000001"


def test_weights_only_folder_is_not_resumable(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(checkpoints.CheckpointError, match="weights only"):
        checkpoints.resolve_resume(tmp_path / "adapter")


# -- loss.png ------------------------------------------------------------------------------------------------


def test_loss_plot_from_the_warm_helper_and_in_process(tmp_path):
    import time

    from trainq.trainer.plotter import LossPlotter

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"type": "step", "step": i, "loss": 5 - i / 10}) + "\n" for i in range(1, 20))
    )
    plotter = LossPlotter().start()
    deadline = time.monotonic() + 120
    while not plotter.is_ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert plotter.is_ready(), "the helper imports matplotlib and says ready"
    plotter.plot(metrics, tmp_path / "warm.png", "warm")
    assert plotter.proc.returncode == 0 and (tmp_path / "warm.png").read_bytes()[:4] == b"\x89PNG"
    LossPlotter().plot(metrics, tmp_path / "cold.png", "cold")  # never started: drawn in this process
    assert (tmp_path / "cold.png").read_bytes()[:4] == b"\x89PNG"
