"""Dependencies, sweeps, finish hooks and lineage in the watcher (docs/workflows.md; ``Workflows``, a Watcher step).

Dependencies: a pending job whose ``after`` has not all ended is *held*: it stays in pending/
but out of admission's start order (``JobIndex.hold``), so a thousand held jobs never hide a
runnable one behind them. Whenever a job is accepted, starts, concludes or is retried, the jobs
held on it are looked at again at once (``deps_changed``), so a dead dependency fails its
dependents, transitively, in the same tick. Ids not in the queue yet are looked at again on every
rescan. Nothing is kept on disk beyond the folders themselves: a restarted watcher holds the
same jobs again from their job.yaml.

Sweeps: a sweep file is claimed into a hidden staging folder (``pending/.sweep-ID``), its
variants are written as ordinary pending jobs ``ID-1`` ... ``ID-N``, then the staging folder is
removed. A crash in between is finished by ``resume_sweeps`` at start-up (variants already there
are kept). The variants are written a slice at a time (``SWEEP_SLICE_S`` of a pass, then the next
pass goes on: ``continue_sweeps``), so a big sweep never holds the loop, its status and its heartbeat.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.daemon import records
from trainq.watcher.daemon.diagnosis import Diagnosis
from trainq.watcher.daemon.jobs import Job, new_run
from trainq.watcher.daemon.state import DependencyBook, LoopState
from trainq.watcher.spec import events
from trainq.watcher.spec.config import passed_through
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import InvalidJobSpec, Problem
from trainq.watcher.spec.folders import JobState
from trainq.watcher.spec.fsutil import read_json, remove_quietly
from trainq.watcher.spec.jobspec import JobSpec, load_job_file
from trainq.watcher.spec.refusals import base_of
from trainq.watcher.spec.sweeps import after_refs, combinations, expand, variant_text
from trainq.watcher.spec.tombstones import REMOVED, ended_status, read_tombstone, record_removal, removal_words
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor.hook_launcher import HookLauncher
from trainq.watcher.supervisor.hooks import has_hook, hook_due

if TYPE_CHECKING:
    from trainq.watcher.daemon.containment import Containment
    from trainq.watcher.daemon.inbox import Candidate

logger = logging.getLogger(__name__)

#: prefix of a sweep's staging folder inside pending/ (hidden: never taken for a job)
SWEEP_STAGING_PREFIX = ".sweep-"
#: seconds of one pass spent writing a sweep's jobs; the rest are written on the next passes (the loop stays live)
SWEEP_SLICE_S = 0.2
#: dependencies named in one waiting_for before "and N more"
_MAX_SHOWN = 4
#: ancestors kept in lineage.parents
MAX_LINEAGE = 50
DEPENDENCY_ADVICE = (
    "A job this one runs after did not end done: fix and retry that job (trainq retry ID), then "
    "retry this one, or submit it with after_policy: any to run whatever their outcome."
)


@dataclass
class _Expansion:
    """A sweep whose jobs are being written: its variants, and the index of the next one to write."""

    sweep_id: str
    staging: Path
    variants: list
    base: str
    next: int = 0


@dataclass(frozen=True)
class DepState:
    """Where one dependency stands: ended (with its final status) or not, in words."""

    dep_id: str
    ended: bool
    ok: bool
    words: str  # "train-a (running)", "prep: no such job yet", "lrs (sweep: 2 of 4 ended; ...)"
    known: bool = True
    evidence: str | None = None  # why it counts as failed


class Workflows:
    """after, sweep, on_finish and fork_of: holding and releasing pending jobs, expanding sweeps, finish hooks.

    Reads the state's root and report. Changes the state's ``deps``, ``jobs`` (holds, releases, adds a sweep's
    jobs), ``plan_due`` and the order counter, and pending jobs' run.json; owns the finish hooks' launcher.
    Runs each job's step inside ``guard``; a pending job that can never start goes to ``retire``.
    """

    def __init__(self, state: LoopState, guard: Containment, *, retire: Callable[[Job, float], None]) -> None:
        self.state = state
        self.guard = guard
        self.retire = retire
        self.hooks = HookLauncher(passed_through(state.env, state.config.env_passthrough))
        self._deps_queue: list[str] = []
        self._sweeps_unfinished = False  # a sweep's expansion failed (a full disk): retried on each rescan
        self._expansions: list[_Expansion] = []  # sweeps whose jobs are still being written (continue_sweeps)
        self.deps_released = False  # a held job was released in this pass: start_pending runs again (daemon.py)

    def reset(self) -> None:
        """Forget what is held on what (rebuilt from job.yaml files by recover(), as at start-up)."""
        self.state.deps = DependencyBook()
        self._deps_queue = []
        self._expansions = []  # recover() finishes them from their staging folders

    # -- accepting -----------------------------------------------------------------------------
    def admit_workflow(self, job: Job, now: float) -> None:
        """A job just entered pending: reject it if its after closes a cycle, else hold it on its dependencies."""
        sweep = (job.run.get("sweep") or {}).get("id")
        if sweep:
            self.state.deps.sweeps.setdefault(sweep, [])
            if job.id not in self.state.deps.sweeps[sweep]:
                self.state.deps.sweeps[sweep].append(job.id)
        if job.spec is not None and job.spec.after:
            cycle = self.find_cycle(job)
            if cycle:
                self._reject_cycle(job, cycle, now)
                return
            self.check_deps(job, now)
        self.deps_changed(job.id, now)

    def find_cycle(self, job: Job) -> list[str] | None:
        """A path job → … → job through ``after`` (sweep ids stand for their jobs), or None."""
        targets = {job.id} | ({job.run["sweep"]["id"]} if job.run.get("sweep") else set())
        stack = [(dep, [job.id, dep]) for dep in job.known_spec.after]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            if node in targets:
                return path
            if node in seen:
                continue
            seen.add(node)
            for member in self.state.deps.sweeps.get(node, ()):
                other = self.state.jobs.get(member)
                if other is not None and other.spec is not None:
                    stack += [(d, [*path, d]) for d in other.spec.after]
            other = self.state.jobs.get(node)
            if other is not None and other.spec is not None:
                stack += [(d, [*path, d]) for d in other.spec.after]
        return None

    def _reject_cycle(self, job: Job, cycle: list[str], now: float) -> None:
        words = " -> ".join(cycle)
        message = f"after: these jobs would wait on each other forever: {words}; remove one of those dependencies"
        job.run.update(
            status="rejected",
            finished_at=iso_utc(now),
            waiting_for=None,
            error=f"pending/{job.id}/job.yaml: {message}",
            errors=[Problem("after", message).to_dict()],
        )
        self._conclude_pending(job, now, f"rejected, dependency cycle {words}")

    # -- dependencies ----------------------------------------------------------------------------
    def check_deps(self, job: Job, now: float) -> None:
        """Hold, release or fail one pending job according to where its dependencies stand."""
        if job.state is not JobState.PENDING or job.spec is None or not job.spec.after:
            return
        states = self._remember_seen(job, [self.dependency_state(dep) for dep in job.spec.after])
        dead = [s for s in states if s.ended and not s.ok]
        if dead and job.spec.after_policy == "ok":
            self.state.deps.forget(job.id, job.spec.after)
            self._fail_dependency(job, dead[0], now)
            return
        waiting = [s for s in states if not s.ended]
        if not waiting:
            self.state.deps.forget(job.id, job.spec.after)
            if job.held:
                self.state.jobs.release(job)
                job.run["waiting_for"] = None
                events.emit(job.paths, "released", now, after=list(job.spec.after))
                self.state.plan_due = True
                self.deps_released = True
                self.state.report.touch()
                logger.info("job %s: dependencies ended (%s); may start", job.id, ", ".join(job.spec.after))
            return
        self.state.deps.wait_on(job.id, job.spec.after)
        if any(not s.known for s in waiting):
            self.state.deps.unknown.add(job.id)
        else:
            self.state.deps.unknown.discard(job.id)
        shown = "; ".join(f"after {s.words}" for s in waiting[:_MAX_SHOWN])
        more = f"; and {len(waiting) - _MAX_SHOWN} more" if len(waiting) > _MAX_SHOWN else ""
        if not job.held:
            self.state.jobs.hold(job)
            events.emit(job.paths, "held", now, after=[s.dep_id for s in waiting], waiting_for=shown + more)
        if job.run.get("waiting_for") != shown + more:
            job.run["waiting_for"] = shown + more
            self.state.report.touch()

    def _remember_seen(self, job: Job, states: list[DepState]) -> list[DepState]:
        """Record in run.json (``after_seen``) each dependency seen in the queue; one seen before and now
        found nowhere, with no tombstone, was removed while no watcher ran: it gets its tombstone now."""
        seen, seen_done = set(job.run.get("after_seen") or ()), set(job.run.get("after_seen_done") or ())
        gone = [s.dep_id for s in states if not s.known and s.dep_id in seen]
        for dep in gone:  # one seen done and cleaned up since stays done
            status = "done" if dep in seen_done else None
            record_removal(
                self.state.root.path,
                dep,
                "done" if status else "unknown",
                status,
                by="found gone when a watcher started",
            )
            self.state.deps.finished[dep] = status or REMOVED
        fresh = [s.dep_id for s in states if s.known and s.dep_id not in seen]
        fresh_done = [s.dep_id for s in states if s.ended and s.ok and s.dep_id not in seen_done]
        if fresh or fresh_done:
            job.run["after_seen"] = sorted(seen | set(fresh))
            job.run["after_seen_done"] = sorted(seen_done | set(fresh_done))
            job.save(durable=False)
        return [self.dependency_state(s.dep_id) if s.dep_id in gone else s for s in states]

    def dependency_state(self, dep: str) -> DepState:
        """Where dependency ``dep`` (a job id or a sweep id) stands now."""
        live = self.state.jobs.get(dep)
        if live is not None:
            return DepState(dep, False, False, f"{dep} ({live.status})")
        status = self._finished_status(dep)
        if status is not None:
            return DepState(dep, True, status == "done", f"{dep} ({status})", evidence=self._dep_evidence(dep, status))
        members = self.sweep_members(dep)
        if members:
            return self._sweep_state(dep, members)
        if self._has_live_folder(dep):  # concluded, its folder not yet moved to done/ or failed/
            return DepState(dep, False, False, f"{dep} (ending)")
        named = self._ids_named(dep)
        if named:
            return DepState(
                dep,
                False,
                False,
                f"{dep}: no job with id {dep}; job {' and '.join(named)} "
                f"{'is' if len(named) == 1 else 'are'} named {dep} (after: takes ids: write "
                f"after: [{named[0]}])",
                known=False,
            )
        return DepState(dep, False, False, f"{dep}: no such job yet", known=False)

    def _has_live_folder(self, dep: str) -> bool:
        """Whether ``dep`` still has a folder in pending/ or running/ (a job between its end and its move)."""
        return any(self.state.root.job_dir(state, dep).is_dir() for state in (JobState.RUNNING, JobState.PENDING))

    def _ids_named(self, name: str) -> list[str]:
        """Ids of the live and recently finished jobs whose name is ``name`` (an ``after:`` that names a name)."""
        live = [job.id for job in self.state.jobs.values() if job.run.get("name") == name and job.id != name]
        recent = [job_id for job_id, entry in self.state.report.recent.items() if entry.get("name") == name]
        return sorted(set(live + recent))[:3]

    def _sweep_state(self, sweep: str, members: list[str]) -> DepState:
        states = [self.dependency_state(m) for m in members]
        ended = [s for s in states if s.ended]
        bad = [s for s in ended if not s.ok]
        if bad:
            return DepState(sweep, True, False, f"{sweep} (sweep)", evidence=f"sweep {sweep}: {bad[0].evidence}")
        if len(ended) == len(states):
            return DepState(sweep, True, True, f"{sweep} (sweep: all {len(states)} done)")
        open_ = [s.words for s in states if not s.ended][:3]
        return DepState(
            sweep,
            False,
            False,
            f"{sweep} (sweep: {len(ended)} of {len(states)} ended; "
            f"{', '.join(open_)}{' ...' if len(states) - len(ended) > 3 else ''})",
        )

    def _finished_status(self, dep: str) -> str | None:
        """A dependency's final status: from done/ or failed/, else its tombstone (``removed``), else None."""
        cached = self.state.deps.finished.get(dep)
        if cached is not None:
            return cached
        for state in (JobState.DONE, JobState.FAILED):
            path = self.state.root.job_dir(state, dep)
            if path.is_dir():
                run = read_json(JobPaths(path).run) or {}
                status = run.get("status") or state.value
                if state is JobState.DONE:
                    status = "done"
                self.state.deps.finished[dep] = status
                return status
        stone = read_tombstone(self.state.root.path, dep)
        if stone is not None:
            self.state.deps.finished[dep] = ended_status(stone)
            return self.state.deps.finished[dep]
        return None

    def _dep_evidence(self, dep: str, status: str) -> str:
        stone = read_tombstone(self.state.root.path, dep) if status == REMOVED else None
        if stone is not None:
            return f"dependency {dep} was {removal_words(stone)}"
        return f"dependency {dep} ended {status}" + self._dep_reason(dep)

    def _dep_reason(self, dep: str) -> str:
        path = self.state.root.job_dir(JobState.FAILED, dep)
        run = read_json(JobPaths(path).run) if path.is_dir() else None
        kind = ((run or {}).get("diagnosis") or {}).get("kind")
        return f" ({kind})" if kind else ""

    def sweep_members(self, sweep: str) -> list[str]:
        """The ids of sweep ``sweep``'s jobs: known from this watcher's life, else read from ``sweep-1``'s run.json."""
        members = self.state.deps.sweeps.get(sweep)
        if members:
            return members
        for state in (*JobState, None):
            run = (
                read_json(JobPaths(self.state.root.job_dir(state, f"{sweep}-1")).run)
                if state is not None
                else read_tombstone(self.state.root.path, f"{sweep}-1")
            )  # its first job removed: its tombstone
            info = (run or {}).get("sweep") or {}
            if info.get("id") == sweep and isinstance(info.get("of"), int):
                members = [f"{sweep}-{i}" for i in range(1, info["of"] + 1)]
                self.state.deps.sweeps[sweep] = members
                return members
        return []

    def deps_changed(self, job_id: str, now: float) -> None:
        """Job ``job_id`` was accepted, started, concluded or retried: look again at the jobs held on it.

        A queue, not recursion: a failure that fails a dependent that fails its own dependents
        goes round this loop, however long the chain.
        """
        self._deps_queue.append(job_id)
        if len(self._deps_queue) > 1:
            return  # an outer call is draining the queue
        while self._deps_queue:
            changed = self._deps_queue[0]
            sweep = self._sweep_of(changed)
            for dep in (changed, sweep) if sweep else (changed,):
                for held_id in sorted(self.state.deps.dependents.get(dep, ())):
                    held = self.state.jobs.get(held_id)
                    if held is None:
                        self.state.deps.dependents.get(dep, set()).discard(held_id)
                    else:
                        self.guard.guarded(held, "plan", self.check_deps, held, now)
            self._deps_queue.pop(0)

    def _sweep_of(self, job_id: str) -> str | None:
        job = self.state.jobs.get(job_id)
        if job is not None:
            return (job.run.get("sweep") or {}).get("id")
        head, _, index = job_id.rpartition("-")
        return head if index.isdigit() and job_id in self.state.deps.sweeps.get(head, ()) else None

    def recheck_unknown(self, now: float) -> None:
        """On each rescan: held jobs waiting on ids not in the queue yet (dropped later, or in done/ by hand)."""
        for job_id in sorted(self.state.deps.unknown):
            job = self.state.jobs.get(job_id)
            if job is None:
                self.state.deps.unknown.discard(job_id)
            else:
                self.guard.guarded(job, "plan", self.check_deps, job, now)
        if self._sweeps_unfinished:
            self._sweeps_unfinished = False
            self.resume_sweeps(now)

    def _fail_dependency(self, job: Job, dead: DepState, now: float) -> None:
        diagnosis = Diagnosis("dependency", DEPENDENCY_ADVICE, dead.evidence or f"dependency {dead.dep_id} failed")
        job.run.update(
            status="failed",
            finished_at=iso_utc(now),
            waiting_for=None,
            error=diagnosis.evidence,
            diagnosis=diagnosis.to_dict(),
        )
        self._conclude_pending(job, now, f"failed, dependency: {diagnosis.evidence}")

    def _conclude_pending(self, job: Job, now: float, words: str) -> None:
        """A pending job that will never start: write its final run.json and move it to failed/."""
        if job.held:
            self.state.jobs.release(job)
        job.save()
        job.dir = self.state.folders.fail(job.id, JobState.PENDING)
        self.state.jobs.move(job, JobState.FAILED)
        logger.info("job %s: pending -> failed, %s", job.id, words)
        self.retire(job, now)

    def after_values(self, job: Job) -> dict[str, str]:
        """``{after:ID}`` → ID's job folder where it is now (done/ID once it ended)."""
        values = {}
        for dep in after_refs(job.spec.raw) if job.spec else ():
            for state in (JobState.DONE, JobState.FAILED, JobState.RUNNING, JobState.PENDING):
                path = self.state.root.job_dir(state, dep)
                if path.is_dir():
                    values[f"after:{dep}"] = str(path)
                    break
        return values

    # -- conclusions -------------------------------------------------------------------------------
    def workflow_concluded(self, job: Job, now: float) -> None:
        """A job reached done/ or failed/: remember its status, release or fail its dependents, start its hook."""
        self.state.deps.finished[job.id] = job.status
        if hook_due(job.paths, job.spec, job.status):
            self.hooks.launch(job.id, job.dir)
        self.deps_changed(job.id, now)

    def hook_unfinished(self, job: Job) -> bool:
        """Whether the on_finish hook of the job's current conclusion has yet to end (started now when due).

        A retry.flag waits for it (finishing.py): the retry removes hook.json and moves the folder, so a
        hook not yet taken would never run, and one running would lose its TRAINQ_JOB_DIR and its record.
        """
        return has_hook(job.spec, job.status) and self.hooks.unfinished(job.id, job.dir)

    def workflow_requeued(self, job: Job, now: float) -> None:
        """A finished job is pending again (retry.flag): its conclusion is undone, its next one gets a hook."""
        self.state.deps.finished.pop(job.id, None)
        remove_quietly(job.paths.hook_record)
        self.admit_workflow(job, now)

    def recovered_finished(self, job: Job) -> None:
        """A recently finished job seen at start-up: a hook a crash kept from starting starts now."""
        if hook_due(job.paths, job.spec, job.status):
            self.hooks.launch(job.id, job.dir)

    # -- sweeps ------------------------------------------------------------------------------------
    def admit_sweep(self, cand: Candidate, spec: JobSpec, now: float, taken: Callable[[str], None]) -> None:
        """Claim a sweep file into its staging folder (then ``taken(name)``: the inbox forgets it), then write its jobs."""
        total = combinations(spec.sweep or {})  # a sweep file: its sweep mapping is there
        claimed = self.state.folders.claim_sweep(cand.path, total, SWEEP_STAGING_PREFIX)
        taken(cand.name)
        if claimed is None:
            return
        sweep_id, staging = claimed
        logger.info(
            "sweep %s: inbox/%s -> %d job(s) %s-1 ... %s-%d", sweep_id, cand.name, total, sweep_id, sweep_id, total
        )
        self.expand_staged(sweep_id, staging, now, name=_stem(cand.name), spec=spec)

    def expand_staged(
        self, sweep_id: str, staging: Path, now: float, name: str | None = None, spec: JobSpec | None = None
    ) -> None:
        """Write every variant of the staged sweep that is not in the queue yet, then drop the staging folder.

        ``spec``: the staged file as the inbox just validated it (else it is read again: after a crash).
        The first slice is written now, the rest on the next passes (``continue_sweeps``).
        """
        if any(e.sweep_id == sweep_id for e in self._expansions):
            return  # being written already
        if spec is None:
            try:
                spec = load_job_file(staging / "job.yaml", f"pending/{staging.name}/job.yaml")
            except (InvalidJobSpec, OSError) as exc:
                logger.warning("sweep %s: staged file unreadable (%s); leaving %s", sweep_id, exc, staging)
                return
        variants = expand(spec.raw)
        self.state.deps.sweeps[sweep_id] = [f"{sweep_id}-{v.index}" for v in variants]
        self._expansions.append(_Expansion(sweep_id, staging, variants, spec.name or name or sweep_id))
        self.continue_sweeps(now)

    def continue_sweeps(self, now: float) -> None:
        """Write sweeps' jobs for at most SWEEP_SLICE_S of this pass; wake the loop for the rest."""
        deadline = time.monotonic() + SWEEP_SLICE_S
        while self._expansions:
            expansion = self._expansions[0]
            try:
                done = self._write_slice(expansion, deadline, now)
            except OSError as exc:  # its staging folder keeps the file; the jobs written so far stay
                logger.warning(
                    "sweep %s: writing its jobs failed (%s); trying again on the next rescan", expansion.sweep_id, exc
                )
                self._expansions.pop(0)
                self._sweeps_unfinished = True
                continue
            if not done:
                self.state.wake()
                return
            self._expansions.pop(0)
            self._expanded(expansion, now)

    def _write_slice(self, expansion: _Expansion, deadline: float, now: float) -> bool:
        """Write the expansion's next variants until ``deadline``; True once every variant is written."""
        total = len(expansion.variants)
        while expansion.next < total:
            variant = expansion.variants[expansion.next]
            job = self._write_variant(expansion.sweep_id, variant, total, expansion.base, now)
            expansion.next += 1
            if job is not None:  # held on its dependencies before anything can start it
                self.guard.guarded(job, "admit", self.admit_workflow, job, now)
            if time.monotonic() >= deadline and expansion.next < total:
                self.state.report.touch()
                return False
        return True

    def _expanded(self, expansion: _Expansion, now: float) -> None:
        """Every job of the sweep is written: drop its staging folder and tell its dependents."""
        remove_quietly(expansion.staging / "job.yaml")
        try:
            expansion.staging.rmdir()
        except OSError:
            logger.warning("sweep %s: could not remove its staging folder %s", expansion.sweep_id, expansion.staging)
        self.deps_changed(expansion.sweep_id, now)
        self.state.report.touch()

    def _write_variant(self, sweep_id: str, variant, total: int, base: str, now: float) -> Job | None:
        job_id = f"{sweep_id}-{variant.index}"
        if any((self.state.root.job_dir(s, job_id) / "job.yaml").exists() for s in JobState):
            return None  # written before a crash
        spec = JobSpec.from_checked(variant.data)  # the sweep's validation checked every variant already
        run = new_run(spec, self.state.next_order(), now, name=f"{base}-{variant.index}")
        run["submitted_from"] = base_of(spec, self.state.root.path)
        run.update(id=job_id, sweep={"id": sweep_id, "index": variant.index, "params": variant.params, "of": total})
        text = variant_text(variant.data, sweep_id, variant.index, total)
        path = self.state.folders.write_job(job_id, {"run.json": run, "job.yaml": text})  # appears whole (issue 35)
        paths = JobPaths(path)
        records.accepted(paths, run, f"sweep {sweep_id}", None, now)
        st = os.stat(paths.spec)
        job = Job(job_id, JobState.PENDING, path, run, spec, spec_sig=(st.st_size, st.st_mtime_ns, st.st_ino))
        self.state.jobs.add(job)
        return job

    def resume_sweeps(self, now: float) -> None:
        """At start-up: finish sweeps a crash left in their staging folder."""
        pending = self.state.root.state_dir(JobState.PENDING)
        try:
            staged = [e for e in os.scandir(pending) if e.name.startswith(SWEEP_STAGING_PREFIX) and e.is_dir()]
        except FileNotFoundError:
            return
        for entry in staged:
            sweep_id = entry.name[len(SWEEP_STAGING_PREFIX) :]
            logger.info("sweep %s: finishing its expansion interrupted by a crash", sweep_id)
            self.expand_staged(sweep_id, Path(entry.path), now)

    # -- lineage -------------------------------------------------------------------------------------
    def lineage_of(self, parent: str, how: str = "fork_of") -> dict:
        """run.json's lineage for a job forked (or rerun, ``how``) from ``parent``: it, then its parents, nearest first."""
        parents = [parent]
        for state in JobState:
            run = read_json(JobPaths(self.state.root.job_dir(state, parent)).run)
            if run is not None:
                parents += list((run.get("lineage") or {}).get("parents") or [])[: MAX_LINEAGE - 1]
                break
        return {how: parent, "parents": parents}


def _stem(file_name: str) -> str:
    stem, dot, suffix = file_name.rpartition(".")
    return stem if dot and suffix.lower() in ("yaml", "yml") and stem else file_name
