"""Why an attempt failed, in one word, one line of evidence and one sentence of advice.

Reads what the supervisor and the job left behind: the exit record, the tail of ``output.log``
(ANSI codes stripped), the tail of ``metrics.jsonl`` and, when readable, the kernel log.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from trainq.watcher.spec.contract import (
    EVENT_RANK_FAILED,
    EXIT_DATA,
    EXIT_NAN,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_SCHEDULE,
    EXIT_STARTUP,
    RECORD_EVENT,
)
from trainq.watcher.spec.jobspec import DIAGNOSIS_KINDS as KINDS  # the one list, beside retries.on's
from trainq.watcher.spec.records import parse_records, read_metrics_tail, read_tail, strip_ansi  # noqa: F401 (re-exported)

#: longest evidence line kept (characters)
EVIDENCE_MAX_CHARS = 300
#: longest "last lines of the log" evidence for kind unknown (characters)
UNKNOWN_EVIDENCE_MAX_CHARS = 400
#: how much of the kernel ring buffer read_kernel_log keeps (bytes)
KERNEL_LOG_MAX_BYTES = 256 * 1024
#: signal numbers on Linux (diagnosis must not import ``signal``: the supervisor package owns it)
SIGKILL = 9
SIGTERM = 15

_ADVICE = {
    "oom": "Out of memory: lower batch_size (raise grad_accum to keep the effective batch), then raise "
    "grad_accum further, then shorten seq_len, then lower the LoRA rank (lora.r), and retry.",
    "nan": "The loss went non-finite: lower lr (halve it), add warmup (warmup_ratio), or use bf16/fp32 "
    "instead of fp16, then retry from the last good checkpoint.",
    "killed": "The job was killed (SIGKILL) without an out-of-memory trace: check who kills processes on this "
    "machine (and free RAM), then touch retry.flag to resume.",
    "data": "The training data could not be read: check that every data path exists and each row is valid "
    "UTF-8 JSON with text, prompt+completion or messages, then submit again.",
    "timeout": "The job ran past its timeout: raise timeout in the job file or lower max_steps/epochs, then "
    "touch retry.flag to resume from the latest checkpoint.",
    "stalled": "No new output or metrics for longer than stall_after: look for a hung data loader, deadlock or "
    "wait on a lock, or raise stall_after if the job is slow but healthy.",
    "preempted": "The job was stopped by SIGTERM from outside trainq (preemption or shutdown): touch retry.flag "
    "to resume it from its latest checkpoint.",
    "unsatisfiable": "This machine can never run the job: lower resources (gpus, gpu_memory_gb, ram_gb, disk_gb) "
    "to what the machine has, then submit it again.",
    "dependency": "A job this one runs after did not end done: fix and retry that job, then retry this one "
    "(or use after_policy: any to run whatever their outcome).",
    "schedule": "The learning rate applied left the configured schedule (evidence: the step, the expected and the "
    "applied value): look for code that sets the optimizer's lr, a scheduler changed on resume, or the "
    "warm-up settings; fix it, then touch retry.flag to resume from the last checkpoint.",
    "no_checkpoint": 'The job exited with its checkpoint_exit_code ("saved, run me again") but left no checkpoint '
    "newer than the one its attempt started from, so running it again would repeat the same slice: make it save "
    "(and name the checkpoint) before it exits with that code, or exit with another code when it cannot go on, "
    "then touch retry.flag.",
    "startup": "A rank never joined the others at start-up within TRAINQ_RENDEZVOUS_TIMEOUT_S (evidence: which rank "
    "and its last line): on a loaded machine raise TRAINQ_RENDEZVOUS_TIMEOUT_S in the job's env: or lower "
    "train.processes; otherwise read that rank's lines in output.log ([rank N]), then touch retry.flag.",
    "config": "A path or value in the job file does not hold on this machine (evidence above; a file moved or was "
    "removed after submit): fix the job file with trainq edit ID (checked, then run again under the same id); a "
    "retry without an edit would fail the same way.",
    "unknown": "Read the end of output.log (trainq logs ID) for the error, fix its cause, then touch retry.flag.",
}

#: advice for a command job where the trainer's advice names knobs it does not have (train: fields)
_COMMAND_ADVICE = {
    "oom": "Out of memory: make the command use less per step (its own batch_size or sequence length arguments), "
    "or ask for more with resources.gpu_memory_gb / ram_gb, then touch retry.flag.",
    "nan": "The loss went non-finite: lower the learning rate your command uses, add warmup, or use bf16/fp32 "
    "instead of fp16, then touch retry.flag to resume from its last checkpoint.",
    "data": "A file the command reads is missing or unreadable (evidence above): check the paths in command, cwd "
    "and env (relative paths start in cwd, by default the job folder), then submit the job again.",
    "timeout": "The job ran past its timeout: raise timeout in the job file or make the command do less, then "
    "touch retry.flag (it resumes only if the job declares resume_args).",
}


#: log patterns per kind, most specific first; the last matching line of the tail is the evidence
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "oom",
        re.compile(
            r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|trainq: out of memory"
            r"|out of memory|can't allocate memory|std::bad_alloc|CUBLAS_STATUS_ALLOC_FAILED",
            re.IGNORECASE,
        ),
    ),
    (
        "nan",
        re.compile(
            r"\bloss\b[^\n]{0,24}\b(?:is|=|:|became|went)\s*(?:nan|[+-]?inf)\b|\bnan (?:loss|detected|encountered)"
            r"|non-?finite (?:loss|value|gradient)|detected (?:nan|inf)\b|trainq: nan",
            re.IGNORECASE,
        ),
    ),
    (
        "data",
        re.compile(
            r"JSONDecodeError|UnicodeDecodeError|DatasetGenerationError|datasets\.exceptions|ArrowInvalid"
            r"|No such file or directory:?\s*['\"]?[^'\"\s]*\.(?:jsonl?|csv|tsv|txt|parquet|arrow)\b"
            r"|trainq: data error",
            re.IGNORECASE,
        ),
    ),
    (
        "config",
        re.compile(
            # the trainer's ConfigError line names the job file and the field; python and the shells name a script
            r"job\.yaml: (?:train\.[\w.\[\]]+|cwd|command)\S*: "
            r"|can't open file .*\[Errno 2\] No such file or directory"
            r"|^(?:ba|da|z|k)?sh: (?:\d+: )?(?:cannot open |Can't open )?\S+: (?:No such file or directory|cannot open)"
        ),
    ),
)

#: lines that only serve as evidence for a kind decided by the exit code (never decide it on their own)
_EVIDENCE_ONLY = {"preempted": re.compile(r"SIGTERM|preempt", re.IGNORECASE)}

#: kernel OOM-killer lines; group "pid" is the victim
_KERNEL_OOM = re.compile(
    r"(?:Out of memory|oom-kill|oom_reaper)[^\n]*?(?:Killed process |pid=|reaped process )"
    r"(?P<pid>\d+)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Diagnosis:
    """One failure: its kind (one of KINDS), what to do about it, and the log line that shows it."""

    kind: str
    advice: str
    evidence: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"diagnosis kind must be one of {', '.join(KINDS)} (got {self.kind!r})")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "advice": self.advice, "evidence": self.evidence}

    @classmethod
    def from_dict(cls, d: dict) -> Diagnosis:
        return cls(kind=d["kind"], advice=d.get("advice") or advice_for(d["kind"]), evidence=d.get("evidence") or "")


def advice_for(kind: str, train: bool = True) -> str:
    """The one actionable sentence for ``kind``, for a train job or (``train=False``) a command job."""
    if not train and kind in _COMMAND_ADVICE:
        return _COMMAND_ADVICE[kind]
    return _ADVICE.get(kind, _ADVICE["unknown"])


def read_kernel_log(max_bytes: int = KERNEL_LOG_MAX_BYTES) -> str | None:
    """The kernel ring buffer (what ``dmesg`` prints) from /dev/kmsg, or None when it is not readable."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    lines: list[str] = []
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # the ring buffer wrapped under us: the next read resumes at the oldest record
            if not record:
                break
            lines.append(record.decode("utf-8", errors="replace").split(";", 1)[-1].split("\n", 1)[0])
    except OSError:
        return None
    finally:
        os.close(fd)
    return "\n".join(lines)[-max_bytes:]


def stalled_diagnosis(seconds: float, stack: str | None = None) -> Diagnosis:
    """For the watcher's stall rule: no new output or metrics for ``seconds``; ``stack`` says where it waited."""
    evidence = f"no new output or metrics for {seconds:.0f} s" + (f"; {stack}" if stack else "")
    return Diagnosis("stalled", advice_for("stalled"), _clip(evidence))


def unsatisfiable_diagnosis(reason: str) -> Diagnosis:
    """For a job this machine can never run; ``reason`` says what is missing (e.g. "needs 4 GPUs, has 1")."""
    return Diagnosis("unsatisfiable", advice_for("unsatisfiable"), _clip(reason))


def diagnose(
    exit: dict, log_tail: str, metrics_tail: list[dict] | None = None, kernel_log: str | None = None, train: bool = True
) -> Diagnosis | None:
    """Classify a finished attempt; None for a clean success or a user's stop (status cancelled, not a failure).

    ``train``: the job ran the built-in trainer; a command job's advice names no trainer knobs.
    """
    found = _classify(exit, log_tail, metrics_tail, kernel_log)
    if found is None or train or found.advice != advice_for(found.kind):
        return found  # the trainer's own advice, or the executor's, is kept as it was given
    return Diagnosis(found.kind, advice_for(found.kind, train=False), found.evidence)


#: a Python job that could not import a module: the evidence names the module
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '(?P<module>[^']+)'")
#: "touch retry.flag …" up to the end of its sentence, in advice for a job that cannot resume
_RETRY_RESUME = re.compile(r"touch retry\.flag[^.]*")


def fit_advice(diagnosis: Diagnosis | None, log_tail: str, has_resume: bool, program: str | None) -> Diagnosis | None:
    """Advice that names only what applies to this job.

    A job without resume semantics (a command job with no resume_args) is not told that a retry resumes
    from its latest checkpoint; a ``ModuleNotFoundError`` names the interpreter that ran and what to do.
    """
    if diagnosis is None:
        return None
    advice = diagnosis.advice
    missing = _NO_MODULE.search(strip_ansi(log_tail or ""))
    if missing and diagnosis.kind == "unknown":
        who = f"the interpreter that ran, {program}," if program else "the interpreter that ran"
        advice = (
            f"Python could not import {missing['module']!r}: {who} does not have it. Install it there "
            f"({program or 'python'} -m pip install ...), or name the interpreter that has it in command "
            "(an absolute path); a bare python is the watcher's own (its folder comes first on the job's "
            "PATH). Then trainq retry ID."
        )
        return Diagnosis(diagnosis.kind, advice, _clip(missing.group(0)))
    if not has_resume:
        advice = _RETRY_RESUME.sub(
            "touch retry.flag (trainq retry ID) to run it again from the start (the job "
            "declares no resume_args, so nothing resumes)",
            advice,
        )
        advice = advice.replace("resume it from its latest checkpoint", "run it again from the start")
    return diagnosis if advice == diagnosis.advice else Diagnosis(diagnosis.kind, advice, diagnosis.evidence)


def _classify(exit: dict, log_tail: str, metrics_tail: list[dict] | None, kernel_log: str | None) -> Diagnosis | None:
    stop_reason = exit.get("stop_reason")
    code, sig = exit.get("exit_code"), exit.get("signal")
    if stop_reason is None and code == 0 and not sig:
        return None
    if stop_reason == "stop_flag":
        return None
    lines = [ln.strip() for ln in strip_ansi(log_tail or "").splitlines() if ln.strip()]
    if stop_reason == "timeout":
        said = _from_executor(exit)  # a batch system's time limit (Slurm's --time) names itself and its source
        if said is not None and said.kind == "timeout":
            return said
        return _make("timeout", f"stopped at the timeout ({exit.get('stop_requested_at') or 'time unknown'})")
    return (
        _from_silent_node(exit)
        or _from_trainer(metrics_tail)
        or _from_executor(exit)
        or _from_spawn_error(exit)
        or _from_stop_or_code(exit, lines)
        or _from_signal(exit, lines, kernel_log)
        or _from_log(lines)
        or _unknown(exit, lines)
    )


def _from_trainer(metrics_tail: list[dict] | None) -> Diagnosis | None:
    """The last trainer ``event`` record naming a failure kind wins: the trainer knows best. Across Slurm nodes each
    node's torchrun writes its own ``rank_failed``: one that only saw its rank exit (``unknown``: it lost its peer on
    another node) never outranks the one just before it that says what happened (killed, oom, ...)."""
    tail = metrics_tail or []
    for i in range(len(tail) - 1, -1, -1):
        record = tail[i]
        if record.get("type") == RECORD_EVENT and record.get("kind") in KINDS:
            if record.get("event") == EVENT_RANK_FAILED and record.get("kind") == "unknown":
                record = _told_rank_failure(tail[:i]) or record
            evidence = record.get("evidence") or record.get("message") or json.dumps(record, ensure_ascii=False)
            return Diagnosis(
                record["kind"], str(record.get("advice") or advice_for(record["kind"])), _clip(str(evidence))
            )
    return None


def _told_rank_failure(earlier: list[dict]) -> dict | None:
    """The latest ``rank_failed`` with a kind other than ``unknown`` among the ``rank_failed`` events that end
    ``earlier`` (the other nodes' reports of the same failure), or None."""
    for record in reversed(earlier):
        if record.get("type") != RECORD_EVENT or record.get("event") != EVENT_RANK_FAILED:
            return None
        if record.get("kind") in KINDS and record.get("kind") != "unknown":
            return record
    return None


def _from_silent_node(exit: dict) -> Diagnosis | None:
    """A node that went silent under srun (watcher/slurm/silent.py) is the cause; the ranks that then gave up waiting
    for it only followed (their words are in the evidence)."""
    return _from_executor(exit) if exit.get("silent_nodes") else None


def _from_executor(exit: dict) -> Diagnosis | None:
    """An exit record the executor wrote itself (Slurm ended the job: NODE_FAIL, OUT_OF_MEMORY...) names its kind."""
    said = exit.get("executor_diagnosis")
    if not isinstance(said, dict) or said.get("kind") not in KINDS:
        return None
    return Diagnosis(
        said["kind"], str(said.get("advice") or advice_for(said["kind"])), _clip(str(said.get("evidence") or ""))
    )


def _from_spawn_error(exit: dict) -> Diagnosis | None:
    """The command never started: the advice is the fix for the spawn error itself."""
    if not exit.get("spawn_error"):
        return None
    return Diagnosis(
        "config",
        "The command could not be started (evidence above): fix command or cwd with trainq edit ID (checked, then "
        "run again under the same id); a retry without an edit would fail the same way.",
        _clip(exit["spawn_error"]),
    )


def _from_stop_or_code(exit: dict, lines: list[str]) -> Diagnosis | None:
    """A supervisor SIGTERM stop, or one of trainq's own exit codes."""
    if exit.get("stop_reason") == "sigterm":
        return _make("preempted", "the supervisor received SIGTERM and stopped the job")
    code = exit.get("exit_code")
    by_code = {
        EXIT_OOM: "oom",
        EXIT_NAN: "nan",
        EXIT_DATA: "data",
        EXIT_PREEMPTED: "preempted",
        EXIT_SCHEDULE: "schedule",
        EXIT_STARTUP: "startup",
    }
    if code in by_code:
        kind = by_code[code]
        return _make(kind, _last_match(lines, kind) or f"exit code {code}")
    return None


def _from_signal(exit: dict, lines: list[str], kernel_log: str | None) -> Diagnosis | None:
    """SIGKILL/137: oom with OOM evidence (kernel line for the pid, or the log), else killed; SIGTERM: preempted."""
    sig, code = exit.get("signal"), exit.get("exit_code")
    if sig == SIGTERM:
        return _make("preempted", "terminated by SIGTERM from outside trainq")
    if sig != SIGKILL and code != 128 + SIGKILL:
        return None
    kernel_line = _kernel_oom_line(kernel_log, exit.get("job_pid"))
    if kernel_line:
        return _make("oom", kernel_line)
    log_line = _last_match(lines, "oom")
    if log_line:
        return _make("oom", log_line)
    return _make("killed", "killed by SIGKILL" if sig == SIGKILL else f"exit code {code} (SIGKILL)")


def _from_log(lines: list[str]) -> Diagnosis | None:
    """The last log line that matches any kind's pattern decides (it is closest to the failure)."""
    for line in reversed(lines):
        for kind, pattern in _PATTERNS:
            if pattern.search(line):
                return _make(kind, line)
    return None


def _unknown(exit: dict, lines: list[str]) -> Diagnosis:
    """No rule matched: the evidence is the end of the log, so nobody has to open it to see the error."""
    tail: list[str] = []
    for line in reversed(lines):
        if sum(len(t) + 1 for t in tail) + len(line) > UNKNOWN_EVIDENCE_MAX_CHARS:
            break
        tail.insert(0, line)
    if not tail and lines:  # one line longer than the evidence: its end (a log that never wrote a newline)
        return Diagnosis("unknown", advice_for("unknown"), "…" + lines[-1][-(UNKNOWN_EVIDENCE_MAX_CHARS - 1) :])
    if not tail:
        how = (
            f"signal {exit.get('signal_name') or exit.get('signal')}"
            if exit.get("signal")
            else f"exit code {exit.get('exit_code')}"
        )
        return _make("unknown", f"{how}; output.log is empty")
    return Diagnosis("unknown", advice_for("unknown"), "\n".join(tail)[-UNKNOWN_EVIDENCE_MAX_CHARS:])


def _last_match(lines: list[str], kind: str) -> str | None:
    """The last line matching ``kind``'s pattern."""
    pattern = {**dict(_PATTERNS), **_EVIDENCE_ONLY}[kind]
    return next((line for line in reversed(lines) if pattern.search(line)), None)


def _kernel_oom_line(kernel_log: str | None, pid: int | None) -> str | None:
    """The kernel's OOM-killer line for ``pid`` (any victim when the pid is unknown)."""
    for line in reversed((kernel_log or "").splitlines()):
        match = _KERNEL_OOM.search(line)
        if match and (pid is None or int(match.group("pid")) == int(pid)):
            return line.strip()
    return None


def _make(kind: str, evidence: str) -> Diagnosis:
    return Diagnosis(kind, advice_for(kind), _clip(evidence))


def _clip(text: str) -> str:
    """Stripped, at most EVIDENCE_MAX_CHARS characters."""
    text = text.strip()
    return text if len(text) <= EVIDENCE_MAX_CHARS else text[: EVIDENCE_MAX_CHARS - 1] + "…"
