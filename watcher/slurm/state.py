"""What Slurm says about trainq's batch jobs: the one squeue per poll, the tags, and how an ended job ended.

* Every submission carries a tag in ``--comment``: ``trainq:<queue key>:<job id>:<attempt>:<token>``. The queue
  key tells two queue roots of one user apart; the token tells two submissions of one attempt apart. A sweep's
  job array carries ``trainq:<queue key>:<sweep id>:array:<token>``; its task ``i`` is the sweep's job ``i``.
* ``SqueueQuery`` is the poll: ONE ``squeue -j <the queue's job ids> -t all -r`` per poll, run in the background
  so the watcher's loop never waits for the controller. It asks only about the queue's own jobs, and ``-t all``
  brings a job that ended (within MinJobAge) with its final state and exit status in the same answer, so no
  job is asked about on its own. Only while a submission is unconfirmed (its id unknown) does the poll list the
  user's jobs (``--me``), to find it by its tag.
* ``sacct_jobs`` asks slurmdbd (where accounting exists) how jobs the controller no longer knows ended.
* ``ended_outcome`` turns a batch job that ended without the supervisor's exit record into one.

This module runs Slurm's commands (``subprocess``); watcher/slurm/executor.py decides what to do with the answers.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import open_no_follow, read_json

#: Slurm states in which a batch job is queued or still has processes
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)
#: states in which the job has not started yet (waiting_for shows Slurm's reason)
QUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
#: states in which the batch job's supervisor runs; its exit record cannot be final yet (no file is read)
RUNNING_STATES = frozenset({"CONFIGURING", "RUNNING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING"})
#: pseudo-state: Slurm no longer knows the id (purged after MinJobAge)
GONE = "GONE"
#: tag prefix in --comment
TAG_PREFIX = "trainq"
#: the attempt field of a job array's tag (its tasks are the attempts of several jobs)
ARRAY_TAG = "array"
#: exit status of slurm.sh when the job folder is not visible on the node (sysexits EX_CONFIG)
EXIT_NOT_SHARED = 78
#: exit statuses of slurm.sh when the watcher's Python cannot be run on the node (as a shell reports it)
EXIT_NO_PYTHON = (126, 127)
#: Slurm's own output file in the job folder (only the batch script's and slurmstepd's messages land here)
SLURM_OUTPUT = "slurm-%j.out"
#: a squeue that has not answered after this long is killed and Slurm counted as unreachable (s)
QUERY_TIMEOUT_S = 60.0
#: stderr fragments meaning "the controller cannot be reached": nothing was submitted
REFUSED = re.compile(
    r"connect failure|Connection refused|Unable to contact slurm controller|Could not establish a configuration "
    r"source|Unable to establish|Transport endpoint|Slurm backup controller in standby mode|Unable to resolve",
    re.IGNORECASE,
)
#: stderr fragments meaning "the controller got the request but did not answer": it may have been submitted
NO_ANSWER = re.compile(
    r"Socket timed out|Zero Bytes were transmitted|Communication connection failure"
    r"|slurm_persist_conn",
    re.IGNORECASE,
)
#: sbatch's words for a QOS or association limit on the jobs one may have submitted (AssocMaxSubmitJobLimit,
#: QOSMaxSubmitJobPerUserLimit, QOSGrpSubmitJobsLimit, ...; then "Job violates accounting/QOS policy (job submit
#: limit, ...)"): the count goes down as jobs end, so the job waits and is submitted again later
LIMITED = re.compile(r"Submit\w*Limit|violates accounting/QOS policy", re.IGNORECASE)
#: sbatch's refusal when no node of the partition has what the job asks for (GPUs, memory, CPUs, nodes)
NODE_CONFIG = re.compile(r"Requested node configuration is not available|Node count specification invalid", re.I)
#: the advice for that refusal: the job's own resources are what trainq turns into --gres, --mem and --nodes
RESOURCES_ADVICE = (
    "No node of the partition has what the job asks for: lower resources.gpus (or gpus_per_node), "
    "resources.ram_gb or resources.nodes in the job file (trainq passes them to sbatch as --gres, --mem and "
    "--nodes), or choose a partition whose nodes have them (slurm.partition); then submit it again."
)
#: ... unless the limit named is one the job itself breaks (its size or time): that never changes, it is refused
PER_JOB_LIMIT = re.compile(r"PerJob|MaxWall|Wall\w*Limit|MinTRES|MinCpu|MinNode", re.IGNORECASE)
#: scontrol's answer for an id it no longer knows: purged after MinJobAge, or a cancelled array task that never
#: started ("Job 12_3 not found", printed on stdout)
NO_SUCH_JOB = re.compile(r"Invalid job id|^Job \S+ not found", re.MULTILINE)
#: slurmstepd's words when it kills a step for its memory: without cgroups (JobAcctGatherParams=OverMemoryKill)
#: the job then ends FAILED, not OUT_OF_MEMORY, and only Slurm's output file says why
MEMORY_KILL = re.compile(r"exceeded (?:job )?memory limit|oom[-_ ]kill", re.IGNORECASE)
#: signal numbers on Linux (slurm_state does not import ``signal``: the supervisor package owns it)
SIGKILL, SIGTERM = 9, 15
#: the time-limit warning (--signal=B:USR1@lead); a batch job killed by it died before slurm.sh's first line trapped
#: it, while slurmstepd still launched the script: Slurm shows FAILED/JobLaunchFailure, and no supervisor ran
SIGUSR1 = 10
SIGNAL_NAMES = MappingProxyType({SIGKILL: "SIGKILL", SIGTERM: "SIGTERM", SIGUSR1: "SIGUSR1"})

NOT_SHARED_ADVICE = (
    "Put the queue root on a filesystem that the watcher's machine and every Slurm node mount at "
    "the same path (NFS, Lustre, BeeGFS...), then touch retry.flag."
)


@dataclass(frozen=True)
class SlurmJob:
    """One batch job as Slurm last showed it."""

    state: str
    reason: str = ""
    node: str = ""
    comment: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def has_ended(self) -> bool:
        return self.state not in LIVE_STATES and self.state != GONE


def is_warned_at_launch(job: SlurmJob) -> bool:
    """Slurm's time-limit warning killed the batch job before slurm.sh could trap it (nothing of trainq ran)."""
    return job.has_ended and job.exit_signal == SIGUSR1


def queue_key(root: Path) -> str:
    """8 hex digits naming the queue root, so two queues of one user never adopt each other's jobs."""
    return hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:8]


def make_tag(key: str, job_id: str, attempt: int, token: str) -> str:
    """The --comment of one submission; job ids are folder names, so ':' is replaced to keep it parseable."""
    return f"{TAG_PREFIX}:{key}:{job_id.replace(':', '_')}:{attempt}:{token}"


def make_array_tag(key: str, sweep_id: str, token: str) -> str:
    """The --comment of one job array (a sweep's attempts submitted together)."""
    return f"{TAG_PREFIX}:{key}:{sweep_id.replace(':', '_')}:{ARRAY_TAG}:{token}"


def tag_attempt(tag: str, key: str) -> str | None:
    """``job:attempt`` of a tag of queue ``key`` (submissions of one attempt share it), else None."""
    parts = tag.split(":")
    if len(parts) != 5 or parts[0] != TAG_PREFIX or parts[1] != key:
        return None
    return f"{parts[2]}:{parts[3]}"


def duplicate_key(slurm_id: str, tag: str, key: str) -> str | None:
    """What two live Slurm jobs share when they run the same attempt: ``job:attempt`` for one job, and for a
    task of a job array its tag and index (an array submitted twice under one tag has each task twice)."""
    attempt = tag_attempt(tag, key)
    if attempt is None or not attempt.endswith(f":{ARRAY_TAG}"):
        return attempt
    return f"{tag}#{array_index(slurm_id)}"


def array_index(slurm_id: str) -> int | None:
    """The task index of an array task's id ``<array id>_<index>``; None for a plain job id."""
    base, sep, index = slurm_id.partition("_")
    return int(index) if sep and base.isdigit() and index.isdigit() else None


def array_task_id(array_id: str, index: int) -> str:
    """Slurm's id of task ``index`` of job array ``array_id`` (what squeue -r, scontrol and scancel use)."""
    return f"{array_id.partition('_')[0]}_{index}"


def array_spec(indices: list[int]) -> str:
    """``--array``'s index list, runs compressed: [1, 2, 3, 5, 7, 8] -> ``1-3,5,7-8``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class SqueueQuery:
    """One squeue running in the background; output goes to temporary files so it can never block on a pipe.

    ``ids``: the Slurm job ids to ask about (an array's tasks by the array's id); None lists all of the user's jobs.
    """

    #: -O fields, each ended by "|" and without a width (nothing is cut); the tag last, so a "|" in it stays there
    FIELDS = ("JobArrayID", "State", "Reason", "BatchHost", "exit_code", "Comment")
    FORMAT = ",".join(f"{field}:|" for field in FIELDS)

    def __init__(self, ids: list[str] | None = None, squeue: str = "squeue"):
        self.started = time.monotonic()
        self.ids = ids
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            squeue_argv(ids, squeue), stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err, close_fds=True
        )

    def result(self) -> tuple[int, str, str] | None:
        """(returncode, stdout, stderr) once squeue exited (or was killed after QUERY_TIMEOUT_S), else None.

        squeue -j of ONE id Slurm no longer knows exits 1 ("Invalid job id specified"): that is an empty answer.
        """
        if self.proc.poll() is None:
            if time.monotonic() - self.started <= QUERY_TIMEOUT_S:
                return None
            return -1, "", f"squeue did not answer in {QUERY_TIMEOUT_S:g} s"
        out, err = _read_all(self._out), _read_all(self._err)
        if self.proc.returncode != 0 and self.ids and NO_SUCH_JOB.search(err + out):
            return 0, "", ""
        return self.proc.returncode, out, err

    def close(self) -> None:
        """Kill (if still running), reap, and drop the temporary files."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


def squeue_argv(ids: list[str] | None, squeue: str = "squeue") -> list[str]:
    """The poll's squeue: these ids in every state (ended ones too), else all of the user's jobs."""
    argv = [squeue, "-h", "-r", "-t", "all", "-O", SqueueQuery.FORMAT]
    return argv + (["-j", ",".join(ids)] if ids else ["--me"])


def query_ids(tracked: set[str] | list[str]) -> list[str]:
    """The ids one squeue -j needs for ``tracked``: plain ids, and each job array once (by its id, with -r)."""
    return sorted({i.partition("_")[0] for i in tracked}, key=id_order)


def parse_squeue(out: str) -> dict[str, SlurmJob]:
    """``id|STATE|reason|node|wait status|comment|`` lines (SqueueQuery.FORMAT) into SlurmJobs by id."""
    jobs = {}
    for line in out.splitlines():
        line = line.strip()
        if line.endswith("|"):
            line = line[:-1]
        parts = line.split("|", 5)
        if len(parts) < 2 or not parts[0]:
            continue
        state = parts[1].split()[0] if parts[1] else "UNKNOWN"
        reason, node, status, comment = (parts[2:] + [""] * 4)[:4]
        code, sig = decode_status(status)
        jobs[parts[0]] = SlurmJob(
            state, reason, "" if node in ("n/a", "(null)") else node, "" if comment == "(null)" else comment, code, sig
        )
    return jobs


def decode_status(status: str) -> tuple[int | None, int | None]:
    """squeue's exit_code is the batch script's raw wait status: (exit code, None) or (None, signal)."""
    if not status.strip().isdigit():
        return None, None
    raw = int(status)
    return (None, raw & 0x7F) if raw & 0x7F else (raw >> 8, None)


def accounting_enabled(timeout_s: float) -> bool | None:
    """Whether this cluster keeps job records in slurmdbd (``sacct`` answers), from ``scontrol show config``;
    None when the controller did not answer (asked again later)."""
    try:
        done = run(["scontrol", "show", "config"], timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    fields = dict(re.findall(r"^(\w+)\s*=\s*(\S*)", done.stdout, re.MULTILINE))
    return fields.get("AccountingStorageType", "").endswith("slurmdbd")


#: sacct -P fields (one line per job with -X)
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Reason")


def sacct_jobs(ids: list[str], timeout_s: float) -> dict[str, SlurmJob]:
    """How slurmdbd recorded ``ids`` ended (one ``sacct -j``): jobs the controller has purged still have a record."""
    try:
        done = run(["sacct", "-n", "-X", "-P", "-o", ",".join(SACCT_FIELDS), "-j", ",".join(ids)], timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_sacct(done.stdout) if done.returncode == 0 else {}


def parse_sacct(out: str) -> dict[str, SlurmJob]:
    """``JobID|State|ExitCode|NodeList|Reason`` lines; "CANCELLED by 0" is CANCELLED, ExitCode is "code:signal"."""
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0] or "." in parts[0]:
            continue
        code, _, sig = parts[2].partition(":")
        node = parts[3] if len(parts) > 3 and parts[3] not in ("None assigned", "(null)") else ""
        jobs[parts[0]] = SlurmJob(
            parts[1].split()[0] if parts[1] else "UNKNOWN",
            parts[4] if len(parts) > 4 else "",
            node,
            "",
            int(code) if code.isdigit() else None,
            int(sig) if sig.isdigit() and int(sig) else None,
        )
    return jobs


def find_tagged(tag_prefix: str, timeout_s: float) -> list[tuple[str, SlurmJob]]:
    """Every job Slurm still knows (queued, running or recently ended) whose tag starts with ``tag_prefix``."""
    done = run(squeue_argv(None), timeout_s)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, "squeue", done.stdout, done.stderr)
    found = [(i, j) for i, j in parse_squeue(done.stdout).items() if j.comment.startswith(tag_prefix)]
    return sorted(found, key=lambda pair: id_order(pair[0]))


def run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )


#: how long the look at which node of a NODE_FAIL job failed may take (two Slurm commands, once per such job)
FAILED_NODE_TIMEOUT_S = 10.0


def failed_node(slurm_id: str, job: SlurmJob) -> str:
    """The node that failed under a NODE_FAIL job: those of its nodes Slurm now holds down, drained or not
    responding (squeue names only the batch host, the first node, which need not be the one that failed); the
    batch host when none is down any more or Slurm does not say."""
    try:
        shown = run(["scontrol", "-o", "show", "job", slurm_id], FAILED_NODE_TIMEOUT_S)
        nodes = re.search(r"\bNodeList=(\S+)", shown.stdout or "")
        if shown.returncode != 0 or not nodes or nodes[1] == "(null)":
            return job.node
        down = run(
            ["sinfo", "-h", "-N", "-n", nodes[1], "-t", "down,drain,fail,no_respond", "-o", "%N"], FAILED_NODE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return job.node
    named = sorted(set(down.stdout.split())) if down.returncode == 0 else []
    return ",".join(named) or job.node


def taken_by_slurm(state: str, node: str | None) -> str:
    """The evidence for a job Slurm itself took away (a preemption, a failed node), in Slurm's terms."""
    on = f" on node {node}" if node and node != "(null)" else ""
    if state == "PREEMPTED":
        return f"Slurm preempted the job{on} (PREEMPTED: a job of higher priority took its resources)"
    if state == "NODE_FAIL":
        return (
            f"Slurm node {node} failed while running the job (NODE_FAIL)"
            if on
            else "the Slurm node failed while running the job (NODE_FAIL)"
        )
    return f"Slurm could not boot the node{on} for the job ({state})"


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def id_order(slurm_id: str) -> tuple[int, int, str]:
    """Submission order: plain ids by number, an array's tasks by array id then index."""
    base, _, index = slurm_id.partition("_")
    if not base.isdigit():
        return (0, 0, slurm_id)
    return (int(base), int(index) if index.isdigit() else -1, "")


def _read_all(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


# -- when Slurm ended a job without an exit record ---------------------------------------------------------


def ended_outcome(
    job: SlurmJob,
    code: int | None,
    sig: int | None,
    paths: JobPaths,
    slurm_id: str,
    python: str,
    cancelled_by: str | None = None,
    last_known: str = "",
) -> dict:
    """How a batch job that left no exit record ended: exit_code, signal, stop_reason, evidence, diagnosis.

    ``cancelled_by`` is why the watcher itself scancelled the job (None: it did not); ``last_known`` says what was
    last known of a job Slurm no longer knows.
    """
    node = f" on node {job.node}" if job.node and job.node != "(null)" else ""
    stopped = "stop_flag" if paths.stop_flag.exists() else None
    if job.state == GONE:
        return _outcome(
            None, None, stopped, None if stopped else "unknown", purged_evidence(slurm_id, last_known), PURGED_ADVICE
        )
    if job.state == "CANCELLED" and cancelled_by is None and not stopped:
        return _outcome(None, SIGTERM, CANCELLED_OUTSIDE, "killed", cancelled_evidence(slurm_id, job), CANCELLED_ADVICE)
    if job.state == "CANCELLED" and cancelled_by and not stopped:
        return _outcome(None, SIGTERM, None, "preempted", cancelled_by)
    by_state = {
        "CANCELLED": (None, SIGTERM, stopped, "preempted", f"Slurm cancelled the job{node} (scancel)"),
        "PREEMPTED": (None, SIGTERM, None, "preempted", taken_by_slurm(job.state, job.node)),
        "BOOT_FAIL": (None, SIGKILL, None, "preempted", taken_by_slurm(job.state, job.node)),
        "OUT_OF_MEMORY": (None, SIGKILL, None, "oom", oom_evidence(node)),
        "DEADLINE": (None, SIGKILL, "timeout", "timeout", f"Slurm's deadline ended the job{node}"),
    }
    if job.state == "NODE_FAIL":
        return _outcome(None, SIGKILL, None, "preempted", taken_by_slurm(job.state, failed_node(slurm_id, job)))
    if job.state == "TIMEOUT":
        evidence = time_limit_evidence(paths, f"ended the job{node}")
        return _outcome(None, SIGKILL, "timeout", "timeout", evidence, TIME_LIMIT_ADVICE)
    if is_warned_at_launch(job):
        evidence = time_limit_evidence(
            paths,
            f"is near: Slurm's warning (USR1) came while Slurm was still starting the batch script{node}, before "
            "its first line could hold it, and ended it (Slurm: "
            f"{job.state}/{job.reason or 'JobLaunchFailure'}, signal {SIGUSR1}); Slurm may send the warning up "
            "to 60 s before --signal's lead, so a limit that short leaves no room",
        )
        return _outcome(None, SIGUSR1, "timeout", "timeout", evidence, TIME_LIMIT_ADVICE)
    if job.state in by_state:
        exit_code, signal, stop_reason, kind, evidence = by_state[job.state]
        return _outcome(exit_code, signal, stop_reason, None if stop_reason else kind, evidence)
    if job.state == "COMPLETED":  # slurm.sh exits with the job's status, so 0 means the job succeeded
        return _outcome(0, None, stopped, None, f"Slurm reports COMPLETED{node}")
    return _failed_outcome(code, sig, paths, slurm_id, python, node)


#: advice for an attempt Slurm's own time limit ended or warned: the limit is --time, not the job file's timeout
TIME_LIMIT_ADVICE = (
    "Slurm's time limit ended the job, not trainq's timeout: raise --time where the evidence says it comes from "
    "(or make the job do less), then touch retry.flag to resume from the latest checkpoint."
)


def time_limit_evidence(paths: JobPaths, what: str) -> str:
    """``Slurm's time limit (<where it comes from>) <what>``: slurm.json says where the submission's limit came from."""
    source = (read_json(paths.slurm_record) or {}).get("time_limit")
    return f"Slurm's time limit ({source}) {what}" if source else f"Slurm's time limit {what}"


#: stop_reason of an attempt that someone outside trainq cancelled in Slurm (scancel): the job ends ``cancelled``
CANCELLED_OUTSIDE = "cancelled"
CANCELLED_ADVICE = (
    "Someone cancelled the Slurm job outside trainq (scancel, or an admin); trainq does not run it "
    "again by itself: touch retry.flag (or `trainq retry ID`) to run it again."
)
PURGED_ADVICE = (
    "Slurm forgot the job before trainq saw how it ended (MinJobAge, a controller that lost its state, "
    "or the watcher was stopped for longer than MinJobAge); output.log has whatever the job wrote. "
    "Touch retry.flag to run it again."
)


def cancelled_evidence(slurm_id: str, job: SlurmJob) -> str:
    node = f" on node {job.node}" if job.node and job.node != "(null)" else ""
    when = "before it started" if job.reason == QUEUED_CANCEL_REASON else f"while it ran{node}"
    return f"Slurm job {slurm_id} was cancelled from outside trainq (scancel or an admin) {when}"


#: SlurmJob.reason of a job array's task that left the queue without a record: Slurm keeps none for a task
#: cancelled before it started, while its array's other tasks are still known
QUEUED_CANCEL_REASON = "cancelled while queued"


def purged_evidence(slurm_id: str, last_known: str) -> str:
    known = f"; last known: {last_known}" if last_known else ""
    return (
        f"Slurm no longer knows job {slurm_id} and trainq's supervisor left no exit record (the job was purged "
        f"from slurmctld, after MinJobAge, before its end was seen){known}"
    )


def oom_evidence(node: str) -> str:
    return f"Slurm killed the job{node}: out of memory (more than its --mem, from resources.ram_gb)"


def killed_for_memory(paths: JobPaths, slurm_id: str) -> str:
    """The line of Slurm's output file saying slurmstepd killed the job for its memory, else ""."""
    return _memory_kill_line(_tail_lines(paths.dir / SLURM_OUTPUT.replace("%j", slurm_id)))


def _memory_kill_line(tail: str) -> str:
    """The output line naming the memory kill, the one with the figures ("(644571136 > 104857600)") first."""
    lines = [line for line in tail.split(" | ") if MEMORY_KILL.search(line)]
    return max(lines, key=lambda line: ">" in line, default="")


def _failed_outcome(code: int | None, sig: int | None, paths: JobPaths, slurm_id: str, python: str, node: str) -> dict:
    """FAILED (or an unknown state): the job folder not visible, no Python on the node, a kill, or the output's tail."""
    output = paths.dir / SLURM_OUTPUT.replace("%j", slurm_id)
    tail = _tail_lines(output)
    if code == EXIT_NOT_SHARED or (not output.exists() and not paths.started.exists()):
        evidence = tail or (
            f"Slurm could not start the job{node}: it cannot see or write the job folder "
            f"{paths.dir} (no {output.name} was written); the queue root must be on a shared filesystem"
        )
        return _outcome(None, None, None, "unknown", evidence, NOT_SHARED_ADVICE)
    said = _memory_kill_line(tail)
    if said:
        return _outcome(code, sig, None, "oom", f"{oom_evidence(node)}: {said}")
    if code in EXIT_NO_PYTHON:
        return _outcome(
            code,
            None,
            None,
            "unknown",
            tail or f"cannot run {python}{node}",
            f"Install trainq's Python at {python} on every Slurm node (or keep the watcher's virtualenv "
            "on the shared filesystem), then touch retry.flag.",
        )
    if sig:
        return _outcome(
            None,
            sig,
            None,
            "killed" if sig == SIGKILL else "unknown",
            f"the supervisor was killed by signal {sig}{node}" + (f": {tail}" if tail else ""),
        )
    return _outcome(code, None, None, "unknown", tail or f"Slurm reports FAILED{node} (exit code {code})")


def _outcome(
    exit_code: int | None,
    signal: int | None,
    stop_reason: str | None,
    kind: str | None,
    evidence: str,
    advice: str | None = None,
) -> dict:
    diagnosis = None
    if kind is not None:
        diagnosis = {"kind": kind, "evidence": evidence}
        if advice:
            diagnosis["advice"] = advice
    return {
        "exit_code": exit_code,
        "signal": signal,
        "stop_reason": stop_reason,
        "evidence": evidence,
        "diagnosis": diagnosis,
    }


def _tail_lines(path: Path, max_chars: int = 300) -> str:
    """The last lines of Slurm's output file, joined, at most ``max_chars``."""
    try:
        with open_no_follow(path) as f:  # the job can replace it: never a link followed, never a FIFO waited on
            f.seek(max(0, f.seek(0, 2) - 4096))
            text = (f.read(4096) or b"").decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines)[-max_chars:]
