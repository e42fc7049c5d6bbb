"""Runs against a wall: deadlines, the window's ladder, delivery and cost (``Walls``, a Watcher step; docs/wall.md).

Each pass, for every running job: a forecast from its current attempt's step rate (``predicted_end``,
``fits`` against its deadline or the window's final-checkpoint mark, whichever comes first); a job
predicted to miss is flagged once per attempt (an ``event`` record in its metrics.jsonl and a line in
watcher.log); at its deadline, or at the window's final-checkpoint mark, it is stopped the way a
stop.flag stops it and ends ``cancelled`` with ``reason: "deadline"``, resumable. Inside the window's
freeze a pending job starts only when its estimated duration fits before the final-checkpoint mark.
A job that ends done, or stopped at a wall, with ``deliver:`` gets a durable delivery
(supervisor/deliver.py). Each attempt's cost goes into run.json and into the queue's ledger.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainq.watcher.daemon.jobs import Job
from trainq.watcher.faces.progress import merge_progress
from trainq.watcher.spec import events
from trainq.watcher.spec.contract import REASON_DEADLINE, REASON_WINDOW, JobPaths
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import atomic_write_json, exists, is_locked, raise_flag, read_json
from trainq.watcher.spec.records import append_record
from trainq.watcher.spec.units import iso_utc, parse_iso
from trainq.watcher.spec.wall import Forecast, freeze_hold, window_ended
from trainq.watcher.supervisor.deliver import LOCK_NAME, RECORD_NAME, DeliveryQueue

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment
    from trainq.watcher.daemon.state import LoopState

logger = logging.getLogger(__name__)

#: run.json's ``reason`` (and ``stop_requested_by``) for a job stopped at its own deadline, or at the window's mark
WALL_REASONS = (REASON_DEADLINE, REASON_WINDOW)
#: the queue's cost ledger in the root (total of every concluded attempt)
COST_LEDGER = ".trainq-cost.json"
#: how often due deliveries are looked at, seconds
DELIVERY_CHECK_S = 1.0


class Walls:
    """Plans against walls, delivers results and counts cost.

    Reads the state's config (window, cost), root, report and running jobs. Changes running jobs' run.json
    (forecast, a stop at the wall) and a pending job's ``waiting_for``; owns the delivery queue and the
    cost ledger. Runs each job's step inside ``guard``.
    """

    def __init__(self, state: LoopState, guard: Containment) -> None:
        self.state = state
        self.guard = guard
        self.deliveries = DeliveryQueue(state.root.path)
        self._cost_ledger = read_json(state.root.path / COST_LEDGER) or {}
        self._last_delivery_check = 0.0
        self._window_end_said = False  # watcher.log has the "window ended" line (once per end)

    # -- each pass -----------------------------------------------------------------------------
    def keep_walls(self, now: float) -> None:
        """Forecast, flag and stop running jobs against their walls; tend due deliveries."""
        if self.state.config.window is not None or any(
            j.spec and j.spec.deadline for j in self.state.jobs.in_state(JobState.RUNNING)
        ):
            for job in self.state.jobs.in_state(JobState.RUNNING):
                self.guard.guarded(job, "watch", self._face_wall, job, now)
        self.deliveries.reap()
        if now - self._last_delivery_check >= DELIVERY_CHECK_S:
            self._last_delivery_check = now
            self._tend_deliveries()

    def wall_problems(self, now: float) -> list[str]:
        """status.json ``watcher.problems`` lines about walls: a window already ended freezes the whole queue."""
        ended = window_ended(self.state.config.window, now)
        if ended is None:
            self._window_end_said = False
            return []
        if not self._window_end_said:
            self._window_end_said = True
            logger.warning("queue: %s", ended)
        return [ended]

    def _face_wall(self, job: Job, now: float) -> None:
        deadline = job_deadline(job)
        wall, wall_name = self._wall_for(deadline)
        forecast = Forecast.from_progress(_progress(job), now)
        fits = forecast.fits(wall)
        old = job.run.get("forecast") or {}
        new: dict[str, Any] = {
            "deadline": iso_utc(deadline),
            "wall": iso_utc(wall),
            "predicted_end": iso_utc(forecast.predicted_end),
            "fits": fits,
            "words": forecast.words(wall, wall_name),
            "flagged_attempt": old.get("flagged_attempt"),
        }
        if forecast.predicted_end is not None:
            new["remaining_s"] = round(max(0.0, forecast.predicted_end - now), 1)
        if (old.get("fits"), (old.get("predicted_end") or "")[:16]) != (fits, (new["predicted_end"] or "")[:16]):
            self.state.report.touch()
        job.run["forecast"] = new
        if fits is False and old.get("flagged_attempt") != job.attempt:
            new["flagged_attempt"] = job.attempt
            self._flag_miss(job, new, wall_name, now)
        if wall is not None and now >= wall and job.run.get("status") == "running":
            self._stop_at_wall(job, wall_name, now)

    def _wall_for(self, deadline: float | None) -> tuple[float | None, str]:
        """The earlier of the job's deadline and the window's final-checkpoint mark, and its name."""
        window = self.state.config.window
        mark = window.final_checkpoint_at if window is not None else None
        if deadline is not None and (mark is None or deadline <= mark):
            return deadline, "deadline"
        return mark, "final checkpoint"

    def _flag_miss(self, job: Job, forecast: dict, wall_name: str, now: float) -> None:
        """Early, not at the wall: one event record in the job's metrics.jsonl and one line in watcher.log."""
        message = f"predicted to miss the {wall_name} at {forecast['wall']}: {forecast['words']}"
        logger.warning("job %s: %s", job.id, message)
        append_record(
            job.paths.metrics,
            {
                "type": "event",
                "event": "deadline",
                "message": message,
                "predicted_end": forecast["predicted_end"],
                "wall": forecast["wall"],
                "written_by": "watcher",
                "time": now,
            },
        )
        job.save(durable=False)

    def _stop_at_wall(self, job: Job, wall_name: str, now: float) -> None:
        """Stop it as a stop.flag would: it checkpoints, ends cancelled (reason deadline or window), resumable."""
        if job.run.get("stop_requested_by") in WALL_REASONS or exists(job.paths.stop_flag):
            return  # asked already (a user's stop.flag came first: its reason stays `user`)
        reason = REASON_DEADLINE if wall_name == "deadline" else REASON_WINDOW
        job.run.update(stop_requested_by=reason, reason=reason)
        job.save(durable=False)
        raise_flag(job.paths.stop_flag, reason)  # the supervisor's `stopping` record carries the word
        logger.info("job %s: stopping at the %s (checkpoint, then cancelled with reason %s)", job.id, wall_name, reason)

    # -- admission -----------------------------------------------------------------------------
    def held_by_wall(self, job: Job, now: float) -> bool:
        """Inside the window's freeze, hold a job not expected to end before the final-checkpoint mark."""
        window = self.state.config.window
        if window is None or not window.is_frozen(now):
            return False
        reason = freeze_hold(window, now, *self.estimate_s(job))
        if reason is None:
            return False
        if job.run.get("waiting_for") != reason:
            job.run["waiting_for"] = reason
            self.state.report.touch()
        return True

    def estimate_s(self, job: Job) -> tuple[float | None, str]:
        """How long the job should still run: expected_duration, its last forecast, or a finished sweep sibling's run."""
        if job.spec is not None and job.spec.expected_duration_s:
            return job.spec.expected_duration_s, "expected_duration"
        remaining = (job.run.get("forecast") or {}).get("remaining_s")
        if isinstance(remaining, (int, float)):
            return float(remaining), "its last attempt's forecast"
        sweep = (job.run.get("sweep") or {}).get("id")
        if sweep:
            for entry in self.state.report.recent.values():
                if entry.get("sweep") == sweep and entry.get("status") == "done":
                    start, end = parse_iso(entry.get("started_at")), parse_iso(entry.get("finished_at"))
                    if start and end:
                        return end - start, f"sweep sibling {entry['id']} took"
        return None, "estimated"

    # -- cost ----------------------------------------------------------------------------------
    def account_attempt(self, job: Job, attempt: dict | None) -> None:
        """An attempt ended: its cost into run.json (attempt and job) and into the queue's ledger."""
        cost = self.state.config.cost
        if cost is None or attempt is None:
            return
        start, end = parse_iso(attempt.get("started_at")), parse_iso(attempt.get("ended_at"))
        if start is None or end is None:
            return
        attempt["cost"] = cost.of(end - start, len(attempt.get("gpus") or []))
        priced = [a["cost"] for a in job.run.get("attempts") or [] if isinstance(a.get("cost"), dict)]
        folded = (job.run.get("attempts_earlier") or {}).get("cost")  # attempts older than run.json keeps
        if isinstance(folded, dict) and folded.get("currency") == cost.currency:
            priced.append(folded)
        job.run["cost"] = {
            "amount": round(sum(c["amount"] for c in priced), 6),
            "currency": cost.currency,
            "gpu_hours": round(sum(c["gpu_hours"] for c in priced), 6),
        }
        ledger = (
            self._cost_ledger if self._cost_ledger.get("currency") == cost.currency else {"currency": cost.currency}
        )
        ledger["total"] = round(float(ledger.get("total") or 0.0) + attempt["cost"]["amount"], 6)
        ledger["attempts"] = int(ledger.get("attempts") or 0) + 1
        self._cost_ledger = ledger
        atomic_write_json(self.state.root.path / COST_LEDGER, ledger, durable=False)

    def cost_now(self, now: float) -> dict | None:
        """status.json's ``cost``: the ledger plus what running attempts have cost so far."""
        cost = self.state.config.cost
        if cost is None:
            return None
        total = (
            float(self._cost_ledger.get("total") or 0.0) if self._cost_ledger.get("currency") == cost.currency else 0.0
        )
        for job in self.state.jobs.in_state(JobState.RUNNING):
            attempt = job.current_attempt() or {}
            start = parse_iso(attempt.get("started_at"))
            if start is not None:
                total += cost.of(now - start, len(attempt.get("gpus") or []))["amount"]
        return {"total": round(total, 4), "currency": cost.currency}

    def window_now(self, now: float) -> dict | None:
        """status.json's ``window``: the marks, which running jobs will and will not end before the final mark,
        and the projected cost until then."""
        window = self.state.config.window
        if window is None:
            return None
        fits: list[str] = []
        misses: list[str] = []
        projected = 0.0
        cost = self.state.config.cost
        for job in self.state.jobs.in_state(JobState.RUNNING):
            forecast = job.run.get("forecast") or {}
            end = parse_iso(forecast.get("predicted_end"))
            (misses if end is not None and end > window.final_checkpoint_at else fits).append(job.id)
            if cost is not None:
                stop = min(end or window.final_checkpoint_at, window.final_checkpoint_at)
                projected += cost.of(max(0.0, stop - now), len(job.run.get("gpus") or []))["amount"]
        out = {
            **window.to_dict(),
            "fits": fits,
            "misses": misses,
            "phase": "final" if window.is_final(now) else "freeze" if window.is_frozen(now) else "open",
        }
        if cost is not None:
            out["projected_cost"] = {
                "total": round((self.cost_now(now) or {}).get("total", 0.0) + projected, 4),
                "currency": cost.currency,
            }
        return out

    # -- delivery ------------------------------------------------------------------------------
    def deliver_if_due(self, job: Job) -> None:
        """A job with ``deliver:`` that ended done, or was stopped at a wall, gets its delivery made due."""
        if job.spec is None or not job.spec.deliver:
            return
        status = job.run.get("status")
        if status == "done" or (status == "cancelled" and job.run.get("reason") in WALL_REASONS):
            self.deliveries.add(job.id)
            logger.info("job %s: delivery to %s due", job.id, job.spec.deliver.get("to"))

    def _tend_deliveries(self) -> None:
        """Copy finished deliveries into run.json; start a runner for any due one without a live runner."""
        for job_id in self.deliveries.due():
            job_dir = next(
                (
                    d
                    for d in (self.state.root.job_dir(s, job_id) for s in (JobState.DONE, JobState.FAILED))
                    if d.is_dir()
                ),
                None,
            )
            if job_dir is None:
                self.deliveries.done(job_id)  # removed, or retried: nothing to deliver from here
                continue
            record = read_json(job_dir / RECORD_NAME) or {}
            if record.get("state") in ("verified", "gave_up") and not _runner_alive(job_dir):
                self._record_delivery(job_id, job_dir, record)
                self.deliveries.done(job_id)
            elif not _runner_alive(job_dir):
                self.deliveries.ensure_runner(job_id, job_dir)

    def _record_delivery(self, job_id: str, job_dir: Path, record: dict) -> None:
        paths = JobPaths(job_dir)
        run = read_json(paths.run)
        if run is None:
            return
        run["delivered"] = {k: record.get(k) for k in ("to", "at", "verified", "files", "tries", "error", "skipped")}
        atomic_write_json(paths.run, run, redact=True)
        events.emit(
            paths,
            "delivered",
            to=record.get("to"),
            verified=record.get("verified"),
            files=len(record.get("files") or []),
            tries=record.get("tries"),
            error=record.get("error"),
        )
        if record.get("verified"):
            logger.info(
                "job %s: delivered to %s, verified (%d files)", job_id, record.get("to"), len(record.get("files") or [])
            )
        else:
            logger.warning(
                "job %s: delivery to %s not verified after %s tries: %s",
                job_id,
                record.get("to"),
                record.get("tries"),
                record.get("error"),
            )


def job_deadline(job: Job) -> float | None:
    """The job's deadline in Unix seconds (a duration counts from its first start), or None."""
    if job.spec is None or job.spec.deadline is None:
        return None
    return job.spec.deadline.resolve(parse_iso(job.run.get("started_at")))


def _progress(job: Job) -> dict | None:
    readers = job.readers
    return merge_progress(readers.metrics.fields, readers.log.fields) if readers is not None else None


def _runner_alive(job_dir: Path) -> bool:
    """A delivery runner holds delivery.lock for as long as it works."""
    return is_locked(job_dir / LOCK_NAME)
