"""Which rank of an srun job failed, and with what exit code: each task's own record, not srun's status.

Under srun (``resources.nodes`` > 1 or ``tasks_per_node`` > 1) one rank that exits 7 makes srun end the others
(``--kill-on-bad-exit``) and exit with a status of its own, often 143 (SIGTERM), which reads as a preemption.
``RANK_EXIT_SH`` runs each task's command and then writes ``ranks/<attempt>.<rank>`` in the job folder: the
command's exit status, the time and the task's host. Ranks that srun ends are killed with their wrapper and write nothing, so the
first record with a non-zero status names the rank that failed; ``real_rank_exit`` puts it in the exit record.
"""

from __future__ import annotations

from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import append_line, atomic_write_json

#: what each srun task runs after its rendezvous variables are set: the command, then its record (never exec'd,
#: so the wrapper outlives the command to write it)
RANK_EXIT_SH = (
    '"$@"; s=$?; d="$TRAINQ_JOB_DIR/ranks"; mkdir -p "$d" 2>/dev/null && '
    'echo "$s $(date +%s.%N) $(hostname)" > "$d/$TRAINQ_ATTEMPT.$SLURM_PROCID" 2>/dev/null; exit $s'
)


def rank_records(paths: JobPaths, attempt: int) -> list[tuple[float, int, int]]:
    """(time, rank, exit status) of each rank of ``attempt`` that wrote its record, earliest first."""
    return [(at, rank, status) for at, rank, status, _ in rank_records_with_hosts(paths, attempt)]


def rank_records_with_hosts(paths: JobPaths, attempt: int) -> list[tuple[float, int, int, str]]:
    """(time, rank, exit status, host) of each rank of ``attempt`` that wrote its record, earliest first (the host
    is "" in a record of an older trainq, which wrote none)."""
    found = []
    try:
        entries = list(paths.rank_exits.iterdir())
    except OSError:
        return []
    for entry in entries:
        prefix, _, rank = entry.name.partition(".")
        if prefix != str(attempt) or not rank.isdigit():
            continue
        try:
            status, at, host = ([*entry.read_text(encoding="utf-8").split(), "0", ""])[:3]
            found.append((float(at), int(rank), int(status), host))
        except (OSError, ValueError):
            continue
    return sorted(found)


def real_rank_exit(record: dict, paths: JobPaths) -> dict:
    """The exit record with the first failing rank's own exit code (``failed_rank``, ``srun_exit_code``) when srun
    ran the ranks and one of them failed; else the record unchanged."""
    if (
        record.get("exit_code") == 0
        or record.get("failed_rank") is not None
        or not isinstance(record.get("attempt"), int)
    ):
        return record
    failed = [(at, rank, status) for at, rank, status in rank_records(paths, record["attempt"]) if status != 0]
    if not failed:
        return record
    _, rank, status = failed[0]
    amended = amended_by_rank(record, rank, status)
    srun = amended["srun_exit_code"]
    append_line(
        paths.log, f"trainq: rank {rank} exited {status} first; srun then ended the others (srun's status {srun})"
    )
    try:  # the exit record itself says so too, not only run.json: srun's status next to the rank's own
        atomic_write_json(paths.exit_record, amended)
    except OSError:
        pass  # run.json's attempt still gets both fields
    return amended


def amended_by_rank(record: dict, rank: int, status: int) -> dict:
    """The exit record with rank ``rank``'s own exit status in place of srun's (kept as ``srun_exit_code``)."""
    srun = record.get("exit_code") if record.get("exit_code") is not None else 128 + int(record.get("signal") or 0)
    return dict(
        record,
        exit_code=status,
        signal=None,
        signal_name=None,
        failed_rank=rank,
        srun_exit_code=srun,
        stop_reason=None if record.get("stop_reason") == "sigterm" else record.get("stop_reason"),
    )
