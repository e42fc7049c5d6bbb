"""The poll: one squeue -j of the queue's own jobs per interval, backing off while nothing changes; what its answer
says of each job; unconfirmed submissions found by their tags."""

from __future__ import annotations

import logging
import math
import subprocess
import time
from typing import TYPE_CHECKING

from trainq.watcher.slurm.records import (
    NoAnswer,
    Unconfirmed,
    attempt_ended,
    claimed_id,
)
from trainq.watcher.slurm.state import (
    GONE,
    QUEUED_CANCEL_REASON,
    QUEUED_STATES,
    RUNNING_STATES,
    SlurmJob,
    SqueueQuery,
    accounting_enabled,
    array_task_id,
    duplicate_key,
    find_tagged,
    first_line,
    id_order,
    parse_squeue,
    query_ids,
    sacct_jobs,
)
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import ExecutorUnavailable, SpawnFailed
from trainq.watcher.spec.fsutil import read_json
from trainq.watcher.spec.units import iso_utc

if TYPE_CHECKING:
    from trainq.watcher.slurm.parts import SlurmParts
else:
    SlurmParts = object  # the parts' shared attributes, declared for the type checker only (parts.py)

logger = logging.getLogger(__name__)

#: how long the one ``scontrol show config`` (does sacct answer here?) may hold the loop (s)
ACCOUNTING_TIMEOUT_S = 5.0
#: squeue answers that must miss an unconfirmed submission's tag before a full lookup may resubmit it
UNCONFIRMED_POLLS = 2


class Polling(SlurmParts):
    """How SlurmExecutor polls: one squeue -j per interval, backed off; what an answer says of each job (a mixin)."""

    # -- the cached squeue -----------------------------------------------------------------------
    def _state(self, slurm_id: str) -> SlurmJob | None:
        """Slurm's last answer about ``slurm_id``; None while unknown (never asked, or Slurm unreachable)."""
        self._track(slurm_id)
        self._poll(start=False)
        if self._down is not None and self._jobs.get(slurm_id, SlurmJob(GONE)).is_live:
            return None
        return self._jobs.get(slurm_id)

    def _track(self, slurm_id: str, seed: SlurmJob | None = None) -> None:
        if slurm_id in self._tracked:
            return
        self._tracked.add(slurm_id)
        self._tracked_at[slurm_id] = time.monotonic()
        self._wake_poll()
        if seed is not None:
            self._jobs[slurm_id] = seed

    def _forget(self, slurm_id: str) -> None:
        for store in (
            self._jobs,
            self._ended_seen,
            self._beats,
            self._exit_read_mono,
            self._tracked_at,
            self._running_at,
            self._last_known,
            self._node_lost,
        ):
            store.pop(slurm_id, None)
        for suffix in ("#beat", "#synth"):
            self._exit_read_mono.pop(slurm_id + suffix, None)
        self._wake_poll()
        self._seeded.discard(slurm_id)
        self._tracked.discard(slurm_id)
        self._cancelled.discard(slurm_id)

    def _poll(self, start: bool) -> None:
        """Take a finished squeue's answer; with ``start``, launch the next one when its interval has passed.

        At most one squeue per interval, whatever the number of jobs, and none while nothing is tracked and no
        launch asked whether Slurm is up. The interval is poll_s after anything changed, and doubles (up to
        poll_max_s) with each answer that brings nothing new.
        """
        now = time.monotonic()
        if self._query is not None:
            result = self._query.result()
            if result is None:
                return
            query, self._query = self._query, None
            query.close()
            self._absorb(*result, query)
        wanted = self._tracked or self._unconfirmed or now - self._probe_wanted_mono < 2 * self.poll_s
        if start and wanted and now - self._last_query_mono >= self._interval_s:
            self._last_query_mono = now
            if self._accounting is None:
                self._accounting = accounting_enabled(ACCOUNTING_TIMEOUT_S)  # once; a short wait, in the loop
            # by id: only the queue's own jobs; all of the user's while a submission is looked for by its tag
            ids = None if self._unconfirmed or not self._listed_all or not self._tracked else query_ids(self._tracked)
            try:
                self._query = SqueueQuery(ids)
            except OSError as exc:
                self._absorb(-1, "", f"cannot run squeue ({exc.strerror}); install the Slurm client or fix PATH")

    def _wake_poll(self) -> None:
        """Something happened (a submission, a cancel, an end seen in a job folder): poll at poll_s again."""
        if self._interval_s > self.poll_s:
            self._interval_s = self.poll_s

    def _absorb(self, returncode: int, out: str, err: str, query: SqueueQuery | None = None) -> None:
        """One squeue answer: states (final ones too) of the jobs asked about, those gone, duplicates, unconfirmed
        submissions (when it listed all of the user's jobs)."""
        if returncode != 0:
            self._down = f"Slurm is not reachable: {first_line(err) or f'squeue exited {returncode}'}"
            self._interval_s = self.poll_s
            logger.debug("slurm: %s", self._down)
            return
        if self._down is not None:
            logger.info("slurm: reachable again")
        self._down = None
        seen = parse_squeue(out)
        asked_at = query.started if query is not None else time.monotonic()
        listed_all = query is None or query.ids is None
        changed = self._take_states(seen, asked_at)
        if listed_all:
            self._listed_all = True
            self._cancel_duplicates(seen)
            self._resolve_unconfirmed(seen)
        self._interval_s = self.poll_s if changed else min(self.poll_max_s, 2 * self._interval_s)

    def _take_states(self, seen: dict[str, SlurmJob], asked_at: float) -> bool:
        """Record what the answer says of each tracked job; True when anything changed."""
        now = time.monotonic()
        changed, departed = False, []
        for slurm_id in sorted(self._tracked, key=id_order):
            if self._tracked_at.get(slurm_id, -math.inf) > asked_at:
                continue  # submitted after this squeue started: it cannot be in the answer
            job, old = seen.get(slurm_id), self._jobs.get(slurm_id)
            if job is None:
                if old is None or old.is_live:
                    departed.append(slurm_id)
                continue
            self._seeded.discard(slurm_id)
            changed |= old is None or (old.state, old.reason) != (job.state, job.reason)
            self._jobs[slurm_id] = job
            self._last_known[slurm_id] = (
                f"{job.state}{f' on node {job.node}' if job.node else ''} at {iso_utc(time.time())}"
            )
            if job.state in RUNNING_STATES:
                self._running_at.setdefault(slurm_id, now)
            if not job.is_live:
                self._ended_seen.setdefault(slurm_id, now)
        self._settle_departed(departed, seen, now)
        return changed or bool(departed)

    def _settle_departed(self, departed: list[str], seen: dict[str, SlurmJob], now: float) -> None:
        """Jobs the answer no longer lists: cancelled by us, a queued array task cancelled from outside (Slurm
        keeps no record of it), or purged (asked of slurmdbd where accounting exists)."""
        missing = []
        for slurm_id in departed:
            self._seeded.discard(slurm_id)
            if slurm_id in self._cancelled:  # nothing to ask: a stopped sweep of 1000 costs no query
                self._jobs[slurm_id] = SlurmJob("CANCELLED")
                self._ended_seen.setdefault(slurm_id, now)
            else:
                missing.append(slurm_id)
        if missing and self._accounting:
            for slurm_id, job in sacct_jobs(missing, self.command_timeout_s).items():
                if slurm_id in missing:
                    missing.remove(slurm_id)
                    self._jobs[slurm_id] = job
                    self._ended_seen.setdefault(slurm_id, now)
        arrays = {i.partition("_")[0] for i in seen}
        for slurm_id in missing:
            last = self._jobs.get(slurm_id)
            queued = last is not None and last.state in QUEUED_STATES and slurm_id not in self._running_at
            if "_" in slurm_id and queued and slurm_id.partition("_")[0] in arrays:
                self._jobs[slurm_id] = SlurmJob("CANCELLED", QUEUED_CANCEL_REASON)
            else:
                self._jobs[slurm_id] = SlurmJob(GONE, node=last.node if last else "")
            self._ended_seen.setdefault(slurm_id, now)

    def _cancel_duplicates(self, seen: dict[str, SlurmJob]) -> None:
        """Two live Slurm jobs for one attempt of this queue: keep the tracked one, scancel the other."""
        by_attempt: dict[str, list[str]] = {}
        for slurm_id, job in seen.items():
            attempt = duplicate_key(slurm_id, job.comment, self.key) if job.is_live else None
            if attempt is not None:
                by_attempt.setdefault(attempt, []).append(slurm_id)
        for ids in by_attempt.values():
            if len(ids) > 1 and any(i in self._tracked for i in ids):
                for extra in (i for i in ids if i not in self._tracked and i not in self._cancelled):
                    logger.warning(
                        "slurm: job %s duplicates an attempt already running as %s; scancel",
                        extra,
                        ",".join(i for i in ids if i in self._tracked),
                    )
                    self._scancel(extra, None)

    def _resolve_unconfirmed(self, seen: dict[str, SlurmJob]) -> None:
        """Adopt unconfirmed submissions seen by their tag or claim; look further for the others.

        The jobs of one job array share its tag and are resolved together: the array is adopted, or submitted
        again, once for all of them.
        """
        by_tag: dict[str, list[Unconfirmed]] = {}
        for pending in self._unconfirmed.values():
            by_tag.setdefault(pending.tag, []).append(pending)
        for tag, group in by_tag.items():
            found = sorted((i for i, j in seen.items() if j.comment == tag), key=id_order)
            claimed = [c for c in map(claimed_id, group) if c]
            if claimed or found:
                self._adopt(group, (claimed or found)[0])
            else:
                self._look_further(tag, group)

    def _look_further(self, tag: str, group: list[Unconfirmed]) -> None:
        """After UNCONFIRMED_POLLS answers without the tag: ask Slurm about every job it knows, and only when
        none carries the tag, submit again (under the same tag)."""
        lead = group[0]
        lead.missed += 1
        if lead.missed < UNCONFIRMED_POLLS:
            return
        try:  # the live squeue does not list a job that already ended
            everything = find_tagged(tag, self.command_timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.info("job %s: tag lookup failed (%s); trying again next poll", lead.paths.dir.name, exc)
            return
        if everything:
            self._adopt(group, everything[0][0])
            return
        logger.warning(
            "job %s: Slurm has no job tagged %s; submitting attempt %d again%s",
            lead.paths.dir.name,
            tag,
            lead.attempt,
            f" (the job array of {len(group)} jobs)" if lead.index is not None else "",
        )
        try:
            slurm_id = self._submit(lead.argv, lead.paths)
        except NoAnswer:
            lead.missed = 0
            return
        except (ExecutorUnavailable, SpawnFailed) as exc:
            logger.warning("job %s: resubmission failed: %s", lead.paths.dir.name, exc)
            return
        self._adopt(group, slurm_id)

    def _adopt(self, group: list[Unconfirmed], slurm_id: str) -> None:
        """The submission of ``group`` exists as ``slurm_id`` (for an array: any of its tasks)."""
        for pending in group:
            own = slurm_id if pending.index is None else array_task_id(slurm_id, pending.index)
            logger.info(
                "job %s: attempt %d is Slurm job %s (tag %s)", pending.paths.dir.name, pending.attempt, own, pending.tag
            )
            record = read_json(pending.paths.slurm_record) or {"attempt": pending.attempt, "tag": pending.tag}
            self._confirm(pending.paths, record, own)

    def _unconfirmed_for(self, paths: JobPaths, attempt: dict) -> Unconfirmed | None:
        """The attempt's submission that got no answer; re-registered from slurm.json after a watcher restart."""
        pending = self._unconfirmed.get(str(paths.dir))
        if pending is not None or attempt.get("ended_at"):
            return pending
        record = read_json(paths.slurm_record) or {}
        if (
            record.get("tag")
            and not record.get("slurm_job_id")
            and not record.get("refused")
            and attempt.get("n") in (None, record.get("attempt"))
            and not attempt_ended(paths, record.get("attempt"))
        ):
            index = record.get("array_index")
            pending = Unconfirmed(
                paths,
                int(record["attempt"]),
                str(record["tag"]),
                list(record.get("sbatch") or []),
                index=index if isinstance(index, int) else None,
            )
            self._unconfirmed[str(paths.dir)] = pending
        return pending
