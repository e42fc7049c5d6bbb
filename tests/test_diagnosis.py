"""Failure diagnosis: real failing processes run through the supervisor, plus the table's unit cases."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_supervisor import FAKE, Jobs

from trainq.watcher.daemon.diagnosis import (
    KINDS,
    Diagnosis,
    advice_for,
    diagnose,
    read_kernel_log,
    read_metrics_tail,
    read_tail,
    stalled_diagnosis,
    unsatisfiable_diagnosis,
)
from trainq.watcher.spec.contract import EXIT_DATA, EXIT_FAILED, EXIT_NAN, EXIT_OOM, EXIT_PREEMPTED, JobPaths
from trainq.watcher.spec.jobspec import DEFAULT_RETRY_ON, RETRYABLE_KINDS, SCHEMAS_DIR


class Runner(Jobs):
    """Runs a fake trainer under a real supervisor and diagnoses how it ended (cleanup: Jobs')."""

    def start(self, script: str, *args: str, **overrides: object) -> JobPaths:
        argv = overrides.pop("argv", (sys.executable, str(FAKE / script), *args))
        return self.launch(argv, name=f"job{len(self.made)}", **overrides)[0]

    def finish(self, paths: JobPaths) -> Diagnosis | None:
        record = self.wait_exit(paths)
        return diagnose(record, read_tail(paths.log), read_metrics_tail(paths.metrics))

    def run(self, script: str, *args: str, **overrides: object) -> Diagnosis | None:
        return self.finish(self.start(script, *args, **overrides))

    def job_pid(self, paths: JobPaths) -> int:
        self.wait_ready(paths)
        return self.sup.read_started(paths)["job_pid"]


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    r = Runner(tmp_path)
    try:
        yield r
    finally:
        r.cleanup()


# ---------------------------------------------------------------- real processes through the supervisor


def test_real_memory_error_is_oom(runner: Runner) -> None:
    d = runner.run("oom.py")
    assert d.kind == "oom" and "MemoryError" in d.evidence
    assert (
        d.advice.index("batch_size")
        < d.advice.index("grad_accum")
        < d.advice.index("seq_len")
        < d.advice.index("LoRA rank")
    ), "OOM advice follows the ladder"


def test_real_sigkill_without_oom_evidence_is_killed(runner: Runner) -> None:
    d = runner.run("kills_itself.py")
    assert d.kind == "killed" and "SIGKILL" in d.evidence


def test_real_nan_loss_in_the_log_is_nan(runner: Runner) -> None:
    d = runner.run("nan.py")
    assert d.kind == "nan" and d.evidence == "step 2: loss is inf; stopping"


def test_real_exit_nan_code_is_nan(runner: Runner) -> None:
    d = runner.run("nan.py", str(EXIT_NAN))
    assert d.kind == "nan" and "loss is inf" in d.evidence


def test_real_json_decode_error_is_data(runner: Runner) -> None:
    d = runner.run("bad_data.py")
    assert d.kind == "data" and "JSONDecodeError" in d.evidence


def test_real_outside_sigterm_is_preempted(runner: Runner) -> None:
    paths = runner.start("sleeps.py")
    os.kill(runner.job_pid(paths), signal.SIGTERM)  # from outside trainq, not through stop.flag
    d = runner.finish(paths)
    assert d.kind == "preempted" and "SIGTERM" in d.evidence


def test_real_exit_143_after_checkpoint_is_preempted(runner: Runner) -> None:
    paths = runner.start("preempted.py")
    os.kill(runner.job_pid(paths), signal.SIGTERM)
    d = runner.finish(paths)
    assert d.kind == "preempted" and "preemption" in d.evidence


def test_real_unknown_failure_quotes_the_end_of_the_log(runner: Runner) -> None:
    d = runner.run("exits_1.py")
    assert d.kind == "unknown" and d.advice == advice_for("unknown")
    assert d.evidence.endswith("ValueError: the widget count must be even (got 3)")
    assert len(d.evidence) <= 400


def test_real_timeout_is_timeout(runner: Runner) -> None:
    d = runner.run("sleeps.py", timeout_s=0.2, stop_grace_s=0.1)
    assert d.kind == "timeout"


def test_real_success_and_user_stop_have_no_diagnosis(runner: Runner) -> None:
    assert runner.run("succeeds.py") is None
    paths = runner.start("cooperative.py")
    runner.job_pid(paths)
    paths.stop_flag.touch()
    assert runner.finish(paths) is None


def test_real_spawn_error_names_the_missing_command(runner: Runner) -> None:
    paths = runner.start("succeeds.py", argv=("no-such-trainer-cmd",))
    d = runner.finish(paths)
    assert d.kind == "config" and "no-such-trainer-cmd" in d.evidence and "trainq edit ID" in d.advice
    assert "retry.flag" not in d.advice  # a retry cannot help: only an edit can


# ---------------------------------------------------------------- the table, unit by unit


def _exit(code: int | None = 1, sig: int | None = None, **extra: object) -> dict:
    return {"exit_code": code, "signal": sig, "stop_reason": None, "job_pid": 4242, **extra}


@pytest.mark.parametrize(
    "line, kind",
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory", "oom"),
        ("OSError: [Errno 12] Cannot allocate memory", "oom"),
        ("trainq: out of memory at batch_size 8", "oom"),
        ("step 40: loss is nan", "nan"),
        ("ValueError: non-finite loss at step 12", "nan"),
        ("json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)", "data"),
        ("UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0", "data"),
        ("FileNotFoundError: [Errno 2] No such file or directory: '/data/train.jsonl'", "data"),
        ("datasets.exceptions.DatasetGenerationError: An error occurred while generating the dataset", "data"),
    ],
)
def test_log_lines_decide_the_kind(line: str, kind: str) -> None:
    d = diagnose(_exit(1), f'Traceback (most recent call last):\n  File "x.py", line 1\n{line}\n')
    assert d.kind == kind and d.evidence == line


def test_a_file_not_found_for_code_is_not_data() -> None:
    d = diagnose(_exit(1), "FileNotFoundError: [Errno 2] No such file or directory: '/opt/bin/helper'\n")
    assert d.kind == "unknown"


@pytest.mark.parametrize(
    "code, kind", [(EXIT_OOM, "oom"), (EXIT_NAN, "nan"), (EXIT_DATA, "data"), (EXIT_PREEMPTED, "preempted")]
)
def test_trainq_exit_codes_decide_the_kind(code: int, kind: str) -> None:
    d = diagnose(_exit(code), "")
    assert d.kind == kind and d.evidence == f"exit code {code}"
    assert diagnose(_exit(code), "step 9: loss 1.5\n").evidence == f"exit code {code}", "no false evidence"


def test_stop_reasons() -> None:
    assert diagnose(_exit(0, stop_reason="timeout", stop_requested_at="2025-01-01T00:00:00.000Z"), "").kind == "timeout"
    assert diagnose(_exit(None, 15, stop_reason="sigterm"), "").kind == "preempted"
    assert diagnose(_exit(None, 9, stop_reason="stop_flag"), "") is None
    assert diagnose(_exit(0), "all good\n") is None


def test_sigkill_with_a_kernel_oom_line_for_the_pid_is_oom() -> None:
    kernel = (
        "[100.1] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0\n"
        "[100.2] Out of memory: Killed process 4242 (python) total-vm:9000000kB, anon-rss:8000000kB\n"
    )
    d = diagnose(_exit(None, 9), "step 3: loss 1.2\n", kernel_log=kernel)
    assert d.kind == "oom" and "Killed process 4242" in d.evidence
    other = kernel.replace("4242", "999")
    assert diagnose(_exit(None, 9), "step 3\n", kernel_log=other).kind == "killed"
    assert diagnose(_exit(137, None), "", kernel_log=kernel).kind == "oom"
    assert diagnose(_exit(137, None), "").kind == "killed"


def test_the_trainers_event_wins() -> None:
    metrics = [
        {"type": "step", "step": 3, "loss": 1.0},
        {
            "type": "event",
            "kind": "oom",
            "advice": "Lower batch_size from 8 to 4 and set grad_accum 2.",
            "message": "CUDA OOM at step 3 with batch_size 8",
        },
        {"type": "event", "kind": "resumed"},
    ]
    d = diagnose(_exit(EXIT_FAILED), "RuntimeError: something else\n", metrics)
    assert d == Diagnosis(
        "oom", "Lower batch_size from 8 to 4 and set grad_accum 2.", "CUDA OOM at step 3 with batch_size 8"
    )
    assert diagnose(_exit(0), "", metrics) is None, "a clean success stays clean"


def test_a_node_that_went_silent_outranks_the_ranks_that_gave_up_waiting_for_it() -> None:
    """Under srun the ranks of a cut node's peers give up waiting (their torchrun writes a rank_failed event); the
    node side ended srun because a node went silent (watcher/slurm/silent.py): that node is the cause."""
    gave_up = "rank 0 (pid 7 on node1) gave up waiting for the other ranks in a collective (a rank stopped answering)"
    metrics = [{"type": "event", "event": "rank_failed", "kind": "stalled", "evidence": gave_up}]
    said = f"node node2 went silent: rank 0 (on node1) exited 1 ...; the ranks said: {gave_up}"
    exit_record = {**_exit(1), "silent_nodes": ["node2"], "executor_diagnosis": {"kind": "preempted", "evidence": said}}
    d = diagnose(exit_record, "", metrics)
    assert d is not None and d.kind == "preempted" and d.evidence.startswith("node node2 went silent"), d
    assert gave_up in d.evidence
    without = {k: v for k, v in exit_record.items() if k != "silent_nodes"}
    assert diagnose(without, "", metrics).kind == "stalled", "otherwise the trainer's event still wins"


def test_a_rank_that_only_lost_its_peer_on_another_node_does_not_outrank_the_one_killed_there() -> None:
    """Each node's torchrun writes a rank_failed: node2's says its rank was SIGKILLed, node1's (later) only that its
    rank exited 1 (the peer's connection was reset)."""
    killed = "rank 1 (pid 8 on node2) was killed by SIGKILL"
    lost = "rank 0 (pid 7 on node1) exited with code 1; its last line: ... Connection reset by peer"
    metrics = [
        {"type": "step", "step": 3, "loss": 1.0},
        {"type": "event", "event": "rank_failed", "kind": "killed", "evidence": killed},
        {"type": "event", "event": "rank_failed", "kind": "unknown", "evidence": lost},
    ]
    d = diagnose(_exit(137), "", metrics)
    assert d is not None and (d.kind, d.evidence) == ("killed", killed), d
    alone = diagnose(_exit(1), "", [metrics[0], metrics[2]])
    assert alone is not None and alone.kind == "unknown", "with nothing better said, the rank's own words stand"


def test_the_last_matching_line_wins_and_evidence_is_clipped() -> None:
    log = (
        "warning: loss is nan at step 2, rolled back\n"
        + "x" * 50
        + "\n"
        + "torch.OutOfMemoryError: CUDA out of memory. "
        + "y" * 400
        + "\n"
    )
    d = diagnose(_exit(1), log)
    assert d.kind == "oom" and len(d.evidence) <= 300


def test_unknown_without_output_says_so() -> None:
    d = diagnose(_exit(None, 11, signal_name="SIGSEGV"), "")
    assert d.kind == "unknown" and "SIGSEGV" in d.evidence


def test_stalled_and_unsatisfiable() -> None:
    d = stalled_diagnosis(600.4)
    assert d.kind == "stalled" and "600 s" in d.evidence and "stall_after" in d.advice
    u = unsatisfiable_diagnosis("needs 4 GPUs; this machine has 1")
    assert u.kind == "unsatisfiable" and u.evidence == "needs 4 GPUs; this machine has 1"


def test_every_kind_has_advice_and_round_trips() -> None:
    for kind in KINDS:
        d = Diagnosis(kind, advice_for(kind), "evidence")
        assert d.advice and d.advice.endswith(".") and Diagnosis.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError, match="diagnosis kind"):
        Diagnosis("cosmic-rays", "", "")


def test_the_schemas_list_the_same_kinds_as_the_code() -> None:
    """One list of kinds (spec/jobspec.py): run.json and status.json allow each, retries.on all but dependency."""
    for name in ("run.schema.json", "status.schema.json"):
        schema = json.loads((SCHEMAS_DIR / name).read_text())
        assert schema["$defs"]["diagnosis"]["properties"]["kind"]["enum"] == list(KINDS), name
    on = json.loads((SCHEMAS_DIR / "job.schema.json").read_text())["properties"]["retries"]["properties"]["on"]
    assert on["items"]["enum"] == list(RETRYABLE_KINDS) and on["default"] == list(DEFAULT_RETRY_ON)


def test_read_tail_strips_ansi_and_the_cut_line(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"first line that gets cut\n" + b"\x1b[31mred error\x1b[0m\n" + b"bad byte \xff end\n")
    assert read_tail(log) == "first line that gets cut\nred error\nbad byte \ufffd end\n"
    assert read_tail(log, max_bytes=30) == "bad byte \ufffd end\n"
    assert read_tail(tmp_path / "missing.log") == ""
    os.mkfifo(tmp_path / "fifo.log")  # none of these is read, and none blocks
    writer = os.open(tmp_path / "fifo.log", os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(writer, b"from a fifo\n")
        assert read_tail(tmp_path / "fifo.log") == ""
    finally:
        os.close(writer)
    (tmp_path / "link.log").symlink_to(log)
    assert read_tail(tmp_path / "link.log") == ""
    (tmp_path / "folder.log").mkdir()
    assert read_tail(tmp_path / "folder.log") == ""
    d = diagnose(_exit(1), "\x1b[1;31mtorch.OutOfMemoryError: CUDA out of memory\x1b[0m\n")
    assert d.evidence == "torch.OutOfMemoryError: CUDA out of memory"


def test_read_metrics_tail_skips_broken_lines(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"type": "step", "step": 1}\n{"type": "ev\n[1, 2]\n{"type": "event", "kind": "nan"}\n')
    assert read_metrics_tail(metrics) == [{"type": "step", "step": 1}, {"type": "event", "kind": "nan"}]
    assert read_metrics_tail(tmp_path / "none.jsonl") == []


def test_read_kernel_log_returns_text_or_none() -> None:
    text = read_kernel_log()
    assert text is None or isinstance(text, str)
    if os.access("/dev/kmsg", os.R_OK):
        assert text, "a readable /dev/kmsg has at least the boot messages"


def test_a_huge_log_without_a_newline_is_diagnosed_from_its_tail(tmp_path: Path) -> None:
    """The finding: 100 MB and no newline read as "output.log is empty"."""
    from trainq.watcher.daemon.jobs import attempt_log_tail
    from trainq.watcher.spec.contract import JobPaths

    paths = JobPaths(tmp_path)
    with open(paths.log, "wb") as f:
        f.write(b"trainq: attempt 1 started\n")
        chunk = b"\r step 1/9 . . . " * 4096
        for _ in range(100 * 2**20 // len(chunk)):
            f.write(chunk)
        f.write(b"\rRuntimeError: the last words of a progress bar")
    assert paths.log.stat().st_size > 100 * 10**6
    tail = attempt_log_tail(paths)
    assert tail.endswith("RuntimeError: the last words of a progress bar")
    d = diagnose({"exit_code": 1}, tail, [], train=False)
    assert d.kind == "unknown" and d.evidence.endswith("RuntimeError: the last words of a progress bar"), d
    assert "empty" not in d.evidence
    (tmp_path / "one.log").write_bytes(b"x" * 200_000 + b" Segfault in the middle of nowhere")
    d = diagnose({"exit_code": 139}, read_tail(tmp_path / "one.log"), [], train=False)
    assert d.evidence.startswith("…") and d.evidence.endswith("Segfault in the middle of nowhere")
    assert len(d.evidence) <= 400
