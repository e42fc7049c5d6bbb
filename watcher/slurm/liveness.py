"""Is an attempt still alive on its node: Slurm's state, the heartbeat (also while Slurm says RUNNING), the exit
record, the grace for a shared filesystem's caching; and the exit record written for Slurm when the node left none."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from trainq.watcher.slurm.records import append_note, refresh_listing
from trainq.watcher.slurm.state import (
    EXIT_NO_PYTHON,
    EXIT_NOT_SHARED,
    GONE,
    SIGNAL_NAMES,
    SLURM_OUTPUT,
    SlurmJob,
    ended_outcome,
    is_warned_at_launch,
)
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.fsutil import atomic_write_json, read_json
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import lock_state

if TYPE_CHECKING:
    from trainq.watcher.slurm.parts import SlurmParts
else:
    SlurmParts = object  # the parts' shared attributes, declared for the type checker only (parts.py)

logger = logging.getLogger(__name__)

#: reads of running jobs' exit.json per second, all jobs together (the shared filesystem's budget)
EXIT_READS_PER_S = 50.0


class Liveness(SlurmParts):
    """How SlurmExecutor tells a live attempt from a dead one, and writes the exit record Slurm's end left out (a mixin)."""

    def _final(self, record: dict, slurm_id: str) -> dict:
        self._forget(slurm_id)
        return record

    def _look_for_a_start(self, paths: JobPaths, attempt: dict, slurm_id: str) -> None:
        """While the polls are spaced out, a queued job whose supervisor started brings them back to poll_s."""
        if self._interval_s <= self.poll_s:
            return
        if not self._exit_read_due(slurm_id, max(self.poll_s, len(self._tracked) / EXIT_READS_PER_S)):
            return
        if (read_json(paths.started) or {}).get("attempt") == attempt.get("n"):
            self._wake_poll()

    def _cancelled_by(self, paths: JobPaths, slurm_id: str) -> str | None:
        """Why trainq itself scancelled ``slurm_id`` (a lost node, a stop), or None when it did not."""
        if slurm_id in self._node_lost:
            return self._node_lost[slurm_id]
        lost = (read_json(paths.slurm_record) or {}).get("node_lost")
        if isinstance(lost, str) and lost:
            return lost
        return "cancelled by trainq" if slurm_id in self._cancelled else None

    def health(self, paths: JobPaths, attempt: dict, now: float) -> str | None:
        """Why a job Slurm says is RUNNING looks dead on its node, in words (its heartbeat stopped), else None.

        The heartbeat's counter is compared with itself over the watcher's own clock, never with the node's or
        this machine's wall clock. Unchanged for heartbeat_stale_s: the job is shown stalled; for
        heartbeat_dead_s: the node is taken for lost, the batch job is cancelled, and the attempt ends preempted
        (retried where ``retries`` allows).
        """
        slurm_id = None if self._submitting(paths) else self._slurm_id(paths, attempt)
        job = self._jobs.get(slurm_id) if slurm_id else None
        if (
            job is None
            or slurm_id is None
            or job.state != "RUNNING"
            or slurm_id in self._node_lost
            or slurm_id in self._cancelled
        ):
            return None
        quiet_s = self._heartbeat_quiet_s(paths, slurm_id)
        if quiet_s < self.heartbeat_stale_s:
            return None
        node = f" on node {job.node}" if job.node else ""
        said = (
            f"no heartbeat from the node side of Slurm job {slurm_id}{node} for {quiet_s:.0f} s while Slurm says "
            "RUNNING"
        )
        if quiet_s >= self.heartbeat_dead_s:
            self._give_up_on_node(paths, slurm_id, said)
        return said

    def _heartbeat_quiet_s(self, paths: JobPaths, slurm_id: str) -> float:
        """Seconds (watcher's clock) since heartbeat.json last changed for this Slurm job, or since it was seen
        running when no heartbeat of it was ever seen. Read at most once per heartbeat period."""
        now = time.monotonic()
        seen = self._beats.get(slurm_id)
        if seen is None or self._exit_read_due(f"{slurm_id}#beat", min(self.heartbeat_s, self.heartbeat_stale_s / 3)):
            beat = read_json(paths.heartbeat) or {}
            beats = beat.get("beats") if str(beat.get("slurm_job_id")) == slurm_id else None
            if seen is None or seen[0] != beats:
                first = self._running_at.get(slurm_id, now) if beats is None else now
                self._beats[slurm_id] = seen = (beats, first)
        return now - seen[1]

    def _give_up_on_node(self, paths: JobPaths, slurm_id: str, said: str) -> None:
        """The node is lost: say so in slurm.json (a restarted watcher still knows) and output.log, and scancel."""
        evidence = f"{said}; trainq cancelled the job as a node failure"
        self._node_lost[slurm_id] = evidence
        logger.warning("job %s: %s", paths.dir.name, evidence)
        append_note(paths.log, f"trainq: {evidence}")
        record = read_json(paths.slurm_record) or {}
        try:
            atomic_write_json(paths.slurm_record, {**record, "node_lost": evidence})
        except OSError as exc:
            logger.warning(
                "job %s: cannot note the lost node in %s: %s", paths.dir.name, paths.slurm_record.name, exc.strerror
            )
        self._scancel(slurm_id, paths)

    # -- the node's signs of life -------------------------------------------------------------------
    def _node_still_alive(self, paths: JobPaths, slurm_id: str) -> bool:
        """After Slurm said the job ended: a supervisor holding its lock, or a heartbeat still moving."""
        if lock_state(paths) is True:
            return True
        beat = read_json(paths.heartbeat) or {}
        if str(beat.get("slurm_job_id")) != slurm_id or beat.get("ended"):
            return False
        now = time.monotonic()
        seen = self._beats.get(slurm_id)
        if seen is None or seen[0] != beat.get("beats"):
            self._beats[slurm_id] = (beat.get("beats"), now)  # it moved (or we look for the first time)
            return True
        return now - seen[1] < self.heartbeat_stale_s

    def _within_grace(self, paths: JobPaths, slurm_id: str) -> bool:
        """A supervisor that started may have written exit.json that this machine cannot see yet (NFS caching).

        The grace does not hang on seeing supervisor.json (the same caching may hide it): it applies whenever
        Slurm ran the job on a node, and is skipped only when Slurm says the job never reached one (ended while
        queued, or purged unseen) or that slurm.sh stopped before the supervisor (no shared folder, no Python).
        """
        first = self._ended_seen.get(slurm_id)
        if first is None:
            return False
        job = self._jobs.get(slurm_id)
        if job is not None and (job.exit_code in (EXIT_NOT_SHARED, *EXIT_NO_PYTHON) or is_warned_at_launch(job)):
            return False  # slurm.sh stopped (or never began) before the supervisor: nothing can be on its way
        if time.monotonic() - first >= self.exit_grace_s:
            return False
        return slurm_id in self._running_at or self._node_side_seen(paths, slurm_id)

    def _node_side_seen(self, paths: JobPaths, slurm_id: str) -> bool:
        """Any sign that the node side started (its claim, heartbeat, start record, or Slurm's output file), after
        listing the folder (which revalidates an NFS client's cache): not supervisor.json alone."""
        refresh_listing(paths.dir)
        attempt = (read_json(paths.slurm_record) or {}).get("attempt")
        signs = [paths.started, paths.heartbeat, paths.dir / SLURM_OUTPUT.replace("%j", slurm_id)]
        if isinstance(attempt, int):
            signs.append(paths.slurm_claim(attempt))
        return any(p.exists() for p in signs)

    def _exit_read_due(self, slurm_id: str, interval_s: float) -> bool:
        """At most one look at this job's exit.json per ``interval_s``."""
        now = time.monotonic()
        if now - self._exit_read_mono.get(slurm_id, -math.inf) < interval_s:
            return False
        self._exit_read_mono[slurm_id] = now
        return True

    def _requeues(self, paths: JobPaths) -> bool:
        return bool((read_json(paths.slurm_record) or {}).get("requeue"))

    def _own_record(self, paths: JobPaths, attempt: dict) -> dict | None:
        """exit.json if it is this attempt's (a retried job's folder still holds the previous attempt's)."""
        record = read_json(paths.exit_record)
        if record is None or (attempt.get("n") is not None and record.get("attempt") != attempt.get("n")):
            return None
        return record

    def _slurm_id(self, paths: JobPaths, attempt: dict) -> str | None:
        """The attempt's Slurm job id: from run.json, else from slurm.json (the watcher died right after sbatch)."""
        slurm_id = attempt.get("slurm_job_id")
        if slurm_id and not attempt.get("ended_at"):
            return str(slurm_id)  # the usual case: no file to read
        record = read_json(paths.slurm_record) or {}
        known, submitted = attempt.get("n"), int(record.get("attempt") or 0)
        if record.get("slurm_job_id") and (
            known is None or submitted > int(known) or (submitted == int(known) and not slurm_id)
        ):
            if known is not None and submitted == int(known) and not attempt.get("ended_at"):
                attempt["slurm_job_id"] = str(record["slurm_job_id"])  # adopted after an unanswered sbatch
            return str(record["slurm_job_id"])
        return str(slurm_id) if slurm_id else None

    # -- when Slurm ended the job without an exit record ----------------------------------------
    def _synthesize(self, paths: JobPaths, attempt: dict, slurm_id: str, job: SlurmJob) -> dict | None:
        """Write exit.json in the supervisor's place, and say in output.log what Slurm did; None while the job
        folder cannot be written (the watcher tries again at the next poll)."""
        outcome = ended_outcome(
            job,
            job.exit_code,
            job.exit_signal,
            paths,
            slurm_id,
            self.python,
            self._cancelled_by(paths, slurm_id),
            self._what_was_known(paths, slurm_id),
        )
        started = read_json(paths.started) or {}
        now = time.time()
        record = {
            "attempt": attempt.get("n") or (read_json(paths.slurm_record) or {}).get("attempt"),
            "job_pid": started.get("job_pid"),
            "exit_code": outcome["exit_code"],
            "signal": outcome["signal"],
            "signal_name": SIGNAL_NAMES.get(outcome["signal"]),
            "started_at": started.get("started_at"),
            "ended_at": iso_utc(now),
            "stop_reason": outcome["stop_reason"],
            "stop_requested_at": iso_utc(now) if outcome["stop_reason"] == "timeout" else None,
            "signals_sent": [],
            "spawn_error": None,
            "slurm_job_id": slurm_id,
            "slurm_state": job.state,
            "slurm_reason": job.reason,
            "executor_diagnosis": outcome["diagnosis"],
            "written_by": "watcher",
        }
        try:
            atomic_write_json(paths.exit_record, record)
        except OSError as exc:
            logger.warning(
                "job %s: slurm job %s ended %s; cannot write its exit record yet (%s)",
                paths.dir.name,
                slurm_id,
                job.state,
                exc.strerror,
            )
            return None
        said = "is no longer known to Slurm" if job.state == GONE else f"ended {job.state}"
        append_note(
            paths.log,
            f"trainq: Slurm job {slurm_id} {said} without an exit record from trainq's "
            f"supervisor: {outcome['evidence']}",
        )
        logger.info(
            "job %s: slurm job %s ended %s without an exit record; wrote one", paths.dir.name, slurm_id, job.state
        )
        return record

    def _what_was_known(self, paths: JobPaths, slurm_id: str) -> str:
        """What was last known of a job Slurm forgot: this watcher's last sight of it, else the job folder's
        records (submitted, started on a node, last heartbeat)."""
        known = []
        if slurm_id in self._last_known:
            known.append(f"Slurm showed it {self._last_known[slurm_id]}")
        submitted = (read_json(paths.slurm_record) or {}).get("submitted_at")
        if submitted:
            known.append(f"submitted at {submitted}")
        started = read_json(paths.started) or {}
        if started.get("started_at"):
            known.append(f"its supervisor started at {started['started_at']}")
        beat = read_json(paths.heartbeat) or {}
        if str(beat.get("slurm_job_id")) == slurm_id and beat.get("at"):
            known.append(
                f"last heartbeat from node {beat.get('node') or '?'} at {beat['at']}"
                + (" (its supervisor had ended)" if beat.get("ended") else "")
            )
        return ", ".join(known) or "never seen running"
