"""MetricsTail and LogProgress: incremental reads, broken input, truncation, ETA after resume."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainq.watcher.faces.progress import MetricsTail, merge_progress
from trainq.watcher.faces.progress_log import LogProgress

T0 = 1_780_000_000.0


def _line(**record: object) -> bytes:
    return (json.dumps(record) + "\n").encode()


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _steps(first: int, last: int, t_first: float, s_per_step: float, total: int = 1000) -> bytes:
    return b"".join(
        _line(type="step", step=s, total_steps=total, loss=2.0, time=t_first + (s - first) * s_per_step)
        for s in range(first, last + 1)
    )


def test_missing_file_is_no_progress(tmp_path: Path) -> None:
    tail = MetricsTail(tmp_path / "metrics.jsonl")
    assert tail.poll() is False
    assert tail.progress is None and tail.last_record_at is None


def test_half_written_line_waits_for_its_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    line = _line(type="step", step=3, total_steps=10, epoch=0.3, loss=1.5, tokens_per_s=800.0, time=T0)
    _append(path, line[:17])
    tail = MetricsTail(path)
    assert tail.poll() is False and tail.progress is None
    _append(path, line[17:-1])
    assert tail.poll() is False
    _append(path, b"\n")
    assert tail.poll() is True
    assert tail.progress == {
        "step": 3,
        "total_steps": 10,
        "epoch": 0.3,
        "loss": 1.5,
        "eval_loss": None,
        "lr": None,
        "grad_norm": None,
        "tokens_per_s": 800.0,
        "eta_s": None,
    }
    assert tail.last_record_at == T0
    assert [r["step"] for r in tail.new_records] == [3]
    assert tail.poll() is False and tail.new_records == []


def test_byte_by_byte_appends_give_every_record_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    data = _steps(1, 20, T0, 1.0)
    tail = MetricsTail(path)
    seen = []
    for i in range(len(data)):
        _append(path, data[i : i + 1])
        tail.poll()
        seen += [r["step"] for r in tail.new_records]
    assert seen == list(range(1, 21))


def test_malformed_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(
        path,
        b'not json\n[1, 2]\n\xff\xfe\n{"type": "step", "step": \n'
        + _line(type="step", step=5, loss=1.0)
        + b'{"type": "step", "step": "six", "loss": "low"}\n'
        + _line(type="eval", step=5, eval_loss=1.2),
    )
    tail = MetricsTail(path)
    assert tail.poll() is True
    assert len(tail.records_tail) == 3
    assert tail.progress["step"] == 5 and tail.progress["loss"] == 1.0 and tail.progress["eval_loss"] == 1.2


def test_lines_holding_two_objects_or_fragments_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(
        path,
        b'{"type": "step", "step": 1}, {"type": "step", "step": 99}\n{"type": "step", "step": [1\n2]}\n'
        + _line(type="step", step=2, loss=1.0),
    )
    tail = MetricsTail(path)
    assert tail.poll() is True
    assert [r["step"] for r in tail.new_records] == [2]


def test_nan_loss_shows_as_null_not_as_the_old_value(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(path, _line(type="step", step=1, loss=2.0) + b'{"type": "step", "step": 2, "loss": NaN}\n')
    tail = MetricsTail(path)
    tail.poll()
    assert tail.progress["step"] == 2 and tail.progress["loss"] is None


def test_growing_file_is_not_reread_from_the_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = _line(type="checkpoint", step=1, path="checkpoints/step-000001")
    _append(path, first + _steps(2, 500, T0, 0.1))
    tail = MetricsTail(path)
    tail.poll()
    assert tail.last_checkpoint == "checkpoints/step-000001"
    # rewrite the first line in place (same size, same inode): only a reader that starts over would see it
    forged = _line(type="checkpoint", step=1, path="checkpoints/step-00000X")
    assert len(forged) == len(first)
    with open(path, "r+b") as f:
        f.write(forged)
    _append(path, _steps(501, 501, T0 + 50, 0.1))
    assert tail.poll() is True
    assert [r["step"] for r in tail.new_records] == [501]
    assert tail.last_checkpoint == "checkpoints/step-000001"


def test_truncated_file_is_read_again_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(path, _steps(1, 50, T0, 1.0))
    tail = MetricsTail(path)
    tail.poll()
    path.write_bytes(_line(type="step", step=2, loss=3.5))
    assert tail.poll() is True
    assert tail.progress["step"] == 2 and tail.progress["loss"] == 3.5
    assert tail.progress["total_steps"] is None


def test_replaced_file_is_read_again_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(path, _line(type="step", step=1, loss=9.0))
    tail = MetricsTail(path)
    tail.poll()
    new = tmp_path / "new.jsonl"
    new.write_bytes(_line(type="step", step=1, loss=1.0) + _line(type="step", step=2, loss=0.5) + b"x" * 10)
    os.replace(new, path)  # longer than before and a different inode
    assert tail.poll() is True
    assert [r["step"] for r in tail.new_records] == [1, 2] and tail.progress["loss"] == 0.5


def test_checkpoint_and_tail(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = _steps(1, 30, T0, 1.0) + _line(type="checkpoint", step=30, path="checkpoints/step-000030", time=T0 + 30)
    _append(path, records + _line(type="event", event="oom", message="CUDA out of memory", time=T0 + 31))
    tail = MetricsTail(path)
    tail.poll()
    assert tail.last_checkpoint == "checkpoints/step-000030"
    assert len(tail.records_tail) == 20 and tail.records_tail[-1]["event"] == "oom"
    assert tail.last_record_at == T0 + 31


def test_eta_uses_only_this_attempts_throughput(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # attempt 1: steps 1..100 at 10 s/step, killed; attempt 2 resumes from step 80 at 1 s/step
    _append(path, _steps(1, 100, T0, 10.0))
    restart = T0 + 2000.0
    _append(path, _steps(81, 101, restart + 30, 1.0))
    tail = MetricsTail(path, attempt_started_at=restart)
    tail.poll()
    progress = tail.progress
    assert progress["step"] == 101
    assert progress["eta_s"] == pytest.approx(1000 - 101, abs=1)  # 1 step/s, not the history's ~10 s/step


def test_eta_after_resume_without_attempt_time(tmp_path: Path) -> None:
    """Without the attempt's start, a step going backwards marks the resume."""
    path = tmp_path / "metrics.jsonl"
    _append(path, _steps(1, 100, T0, 10.0) + _steps(81, 91, T0 + 5000, 2.0))
    tail = MetricsTail(path)
    tail.poll()
    assert tail.progress["eta_s"] == pytest.approx((1000 - 91) * 2.0, abs=1)


def test_eta_needs_two_records_of_this_attempt(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(path, _steps(1, 50, T0, 1.0) + _steps(51, 51, T0 + 900, 1.0))
    tail = MetricsTail(path, attempt_started_at=T0 + 800)
    tail.poll()
    assert tail.progress["step"] == 51 and tail.progress["eta_s"] is None


_WRITER = textwrap.dedent(r"""
    import json, random, sys, time
    path, total = sys.argv[1], int(sys.argv[2])
    data = b"".join(
        (json.dumps({"type": "step", "step": s, "total_steps": total, "loss": 3.0 / s, "time": 1.0e9 + s}) + "\n").encode()
        for s in range(1, total + 1)
    ) + (json.dumps({"type": "done", "step": total}) + "\n").encode()
    rng = random.Random(7)
    with open(path, "ab", buffering=0) as f:
        i = 0
        while i < len(data):
            n = rng.randint(1, 90)
            f.write(data[i:i + n])
            i += n
            if rng.random() < 0.05:
                time.sleep(0.001)
""")


def test_follows_a_real_writer_process(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "400"])
    tail = MetricsTail(path)
    steps: list[int] = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            writer_done = writer.poll() is not None
            tail.poll()
            steps += [r["step"] for r in tail.new_records if r["type"] == "step"]
            if writer_done and not tail.new_records:
                break
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0
    assert steps == list(range(1, 401))
    assert tail.progress["eta_s"] == 0 and tail.records_tail[-1]["type"] == "done"


def test_log_progress_reads_trainer_dicts(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    _append(
        path, b"loading model...\n  5%|\xe2\x96\x8c   | 5/100 [00:01<00:19,  4.9it/s]\r 10%|#  | 10/100 [00:02<00:18]\r"
    )
    _append(path, b"{'loss': 2.1, 'grad_norm': 0.5, 'learning_rate': 0.0001, 'epoch': 0.1}\n")
    log = LogProgress(path)
    assert log.poll() is True
    # the newest bar (10/100, tqdm's own ETA 18 s until two polls give a rate) and the dict
    assert log.progress == {
        "step": 10,
        "total_steps": 100,
        "epoch": 0.1,
        "loss": 2.1,
        "eval_loss": None,
        "lr": 0.0001,
        "grad_norm": 0.5,
        "tokens_per_s": None,
        "eta_s": 18,
    }
    _append(path, b"{'eval_loss': '1.95', 'eval_runtime': '0.5', 'epoch': '0.2'}\n{'loss': '1.8'")
    assert log.poll() is True and log.progress["eval_loss"] == 1.95 and log.progress["loss"] == 2.1
    _append(path, b", 'grad_norm': '0.4', 'learning_rate': '9e-05', 'epoch': '0.3'}\n")
    assert log.poll() is True and log.progress["loss"] == 1.8 and log.progress["epoch"] == 0.3
    _append(path, b"{'__import__': os.system('true')}\nnothing here\n")
    assert log.poll() is False


def _installed_printer_callback() -> type:
    """transformers' own PrinterCallback, compiled from the installed source without importing torch.

    Importing transformers.trainer_callback pulls in torch (~10 s on these machines); the class itself
    only formats and prints, so its real code runs here on a stand-in base class.
    """
    spec = importlib.util.find_spec("transformers")
    source = (Path(spec.origin).parent / "trainer_callback.py").read_text()
    tree = ast.parse(source)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "PrinterCallback"]
    assert classes, "transformers no longer defines PrinterCallback in trainer_callback.py"
    namespace: dict = {"TrainerCallback": object}
    exec(compile(ast.Module(body=classes, type_ignores=[]), "trainer_callback.py", "exec"), namespace)
    return namespace["PrinterCallback"]


def test_log_progress_parses_what_transformers_prints(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The installed PrinterCallback's output (transformers 5 prints floats as strings)."""
    callback = _installed_printer_callback()()
    state = SimpleNamespace(is_local_process_zero=True, is_world_process_zero=True)
    callback.on_log(None, state, None, logs={"loss": 2.3456789, "grad_norm": 0.5, "learning_rate": 1e-4, "epoch": 0.25})
    callback.on_log(None, state, None, logs={"eval_loss": 2.01, "eval_runtime": 0.3, "epoch": 0.5})
    path = tmp_path / "output.log"
    path.write_text(capfd.readouterr().out)
    log = LogProgress(path)
    assert log.poll() is True, path.read_text()
    assert log.progress["loss"] == pytest.approx(2.346, abs=1e-3)
    assert log.progress["eval_loss"] == pytest.approx(2.01) and log.progress["epoch"] == 0.5


# -- what a script with no trainq code prints (Hugging Face Trainer, tqdm, Lightning) ------------------


def _bar(n: int, total: int, desc: str = "", remaining: str = "00:10", postfix: str = "") -> bytes:
    pct = 100 * n // total
    return f"\r{desc}{pct:3d}%|##        | {n}/{total} [00:05<{remaining}, 2.00it/s{postfix}]".encode()


def test_tqdm_bar_last_segment_gives_step_total_and_eta(tmp_path: Path) -> None:
    """tqdm redraws with a leading \\r: the newest bar is the unterminated last segment."""
    path = tmp_path / "output.log"
    _append(path, b"\rLoading weights: 100%|##########| 21/21 [00:00<00:00, 999it/s]\n")
    _append(path, _bar(5, 120) + _bar(6, 120, remaining="01:57"))
    log = LogProgress(path)
    assert log.poll(now=T0) is True
    progress = log.progress
    assert (progress["step"], progress["total_steps"], progress["eta_s"]) == (6, 120, 117)  # tqdm's own ETA first
    _append(path, _bar(26, 120) + b"\r" + b" " * 40 + b"\r{'loss': '2.5', 'learning_rate': '0.0004', 'epoch': '0.5'}\n")
    _append(path, _bar(0, 8, remaining="?"))  # an evaluation bar: another total, not the run's
    assert log.poll(now=T0 + 10) is True
    progress = log.progress
    # 21 steps in 10 s since the attempt's first bar (step 5): (120 - 26) / 2.1 = 45 s
    assert (progress["step"], progress["total_steps"], progress["eta_s"]) == (26, 120, 45)
    assert (progress["loss"], progress["lr"], progress["epoch"]) == (2.5, 0.0004, 0.5)
    _append(path, b"\r\nWriting model shards: 100%|##########| 1/1 [00:00<00:00, 99it/s]\n")
    assert log.poll(now=T0 + 11) is False and log.progress["step"] == 26


def test_new_attempt_banner_restarts_the_rate(tmp_path: Path) -> None:
    """After a resume the rate counts only the new attempt's steps (not the jump from 0 to the checkpoint)."""
    path = tmp_path / "output.log"
    _append(path, _bar(40, 60, remaining="00:20") + b"\n===== trainq: job a, attempt 2, started x =====\n")
    _append(path, _bar(40, 200, remaining="00:02"))
    log = LogProgress(path)
    log.poll(now=T0)
    assert log.progress["total_steps"] == 200 and log.progress["step"] == 40
    assert log.progress["eta_s"] == 2  # tqdm's until this attempt has a rate of its own
    _append(path, _bar(50, 200))
    log.poll(now=T0 + 5)
    assert log.progress["eta_s"] == 75  # 10 steps / 5 s


def test_lightning_bar_gives_epoch_and_losses(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    _append(path, _bar(3, 10, desc="Sanity Checking DataLoader 0: "))
    _append(path, _bar(45, 100, desc="Epoch 2: ", postfix=", v_num=0, train_loss=2.300, val_loss=2.500"))
    log = LogProgress(path)
    assert log.poll(now=T0) is True
    progress = log.progress
    assert progress["epoch"] == pytest.approx(2.45)
    assert (progress["loss"], progress["eval_loss"], progress["step"]) == (2.3, 2.5, None)


def test_a_record_never_hides_a_field_it_does_not_carry(tmp_path: Path) -> None:
    """metrics.jsonl with only step records, and a Trainer printing loss: status shows both."""
    log_path, metrics_path = tmp_path / "output.log", tmp_path / "metrics.jsonl"
    _append(log_path, _bar(10, 100) + b"\r{'loss': '2.25', 'grad_norm': '0.75', 'epoch': '0.1'}\n")
    _append(metrics_path, _line(type="checkpoint", step=10, path="out/checkpoint-10", time=T0))
    log, tail = LogProgress(log_path), MetricsTail(metrics_path)
    log.poll(now=T0)
    tail.poll()
    merged = merge_progress(tail.fields, log.fields)
    assert (merged["step"], merged["total_steps"], merged["loss"], merged["grad_norm"]) == (10, 100, 2.25, 0.75)
    _append(metrics_path, _line(type="step", step=11, loss=2.0, time=T0 + 1))
    tail.poll()
    merged = merge_progress(tail.fields, log.fields)
    assert (merged["step"], merged["loss"], merged["total_steps"]) == (11, 2.0, 100)  # the newer value wins
    assert merge_progress(MetricsTail(tmp_path / "none").fields, LogProgress(tmp_path / "none.log").fields) is None


def test_metrics_lines_that_are_not_json_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _append(path, b"step 3 loss 2.0\n" + _line(type="step", step=3) + b'[1, 2]\n{"type": "st\n')
    tail = MetricsTail(path)
    assert tail.poll() is True
    assert tail.bad_lines == 3 and tail.progress["step"] == 3


def test_a_finished_logs_last_look_reads_only_its_tail_and_drops_the_cut_line(tmp_path: Path) -> None:
    """``tail_bytes`` (a finished job never polled) reads the end of the file the first read finds (issue 38 moved
    the size check from the constructor into that read): the bar in the last bytes counts, a bar cut in the middle
    and everything before it do not, and lines appended after the look are read on from there."""
    log = tmp_path / "output.log"
    head = "".join(f" 50%|█████     | {n}/999 [00:01<00:01, 9.00it/s]\n" for n in range(1, 400)).encode()
    log.write_bytes(head)
    reader = LogProgress(log, tail_bytes=300)
    _append(log, b"x" * 290 + b"\n 80%|########  | 8/10 [00:01<00:00, 9.00it/s]\n")  # the file the read finds
    assert reader.poll(T0)
    assert reader.fields.values["step"] == 8 and reader.fields.values["total_steps"] == 10
    _append(log, b" 90%|######### | 9/10 [00:01<00:00, 9.00it/s]\n")
    assert reader.poll(T0 + 1)
    assert reader.fields.values["step"] == 9
    whole = LogProgress(log)  # without a bound: the first bar (total 999) sets the total, the 10-step bars differ
    whole.poll(T0)
    assert whole.fields.values["total_steps"] == 999
