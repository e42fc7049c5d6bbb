"""Submitting attempts to Slurm: sbatch options, slurm.sh and slurm.json, the hand-over to the sbatch worker
(submit.py) and what each answer means; scancel, batched."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import shlex
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainq.watcher.slurm.batch import (
    SlurmOptions,
    array_script,
    batch_env,
    batch_script,
    effective_time_min,
    short_limit_warning,
    signal_lead_s,
    srun_argv,
    time_limit_min,
    time_limit_source,
)
from trainq.watcher.slurm.node import HEARTBEAT_S
from trainq.watcher.slurm.records import (
    Held,
    Inflight,
    NoAnswer,
    SlurmRejected,
    SubmitLimited,
    Unconfirmed,
    append_note,
    job_file,
)
from trainq.watcher.slurm.state import (
    LIMITED,
    NO_ANSWER,
    NODE_CONFIG,
    PER_JOB_LIMIT,
    REFUSED,
    RESOURCES_ADVICE,
    SLURM_OUTPUT,
    SlurmJob,
    array_spec,
    array_task_id,
    first_line,
    id_order,
    make_array_tag,
    make_tag,
    run,
)
from trainq.watcher.slurm.submit import Answer
from trainq.watcher.spec.contract import JobPaths
from trainq.watcher.spec.errors import ExecutorUnavailable, SpawnFailed
from trainq.watcher.spec.fsutil import atomic_write, atomic_write_json, json_text, read_json
from trainq.watcher.spec.units import iso_utc
from trainq.watcher.supervisor import LaunchSpec

if TYPE_CHECKING:
    from trainq.watcher.slurm.parts import SlurmParts
else:
    SlurmParts = object  # the parts' shared attributes, declared for the type checker only (parts.py)

logger = logging.getLogger(__name__)

#: seconds per pass spent on taking sbatch's answers (each writes slurm.json); the rest wait for the next pass
ANSWERS_BUDGET_S = 0.3


class Submitting(SlurmParts):
    """How SlurmExecutor submits: sbatch options, the hand-over to the worker, each answer, scancel (a mixin: the state lives in SlurmExecutor.__init__)."""

    # -- submitting ------------------------------------------------------------------------------
    def _prepare(self, spec: LaunchSpec, job_name: str, job_slurm: dict) -> tuple[JobPaths, LaunchSpec, SlurmOptions]:
        """The attempt's LaunchSpec as the node runs it (written to launch.json, 0600) and its sbatch options."""
        job_dir = os.path.abspath(spec.job_dir)
        resources, declared_env = job_file(Path(job_dir))
        # the batch job's starting environment (sbatch's base with --export=ALL, or the node's login environment
        # with --export=NONE, and Slurm's variables) is the base; launch.json adds the job's own on top
        spec = dataclasses.replace(
            spec,
            job_dir=job_dir,
            env=batch_env(spec.env, declared_env | self.passthrough, self.node_env),
            inherit_env=True,
        )
        paths = JobPaths(Path(job_dir))
        options = self.options_for(spec, job_name, job_slurm, resources)
        if options.nodes > 1 or options.tasks_per_node > 1:
            spec = dataclasses.replace(spec, argv=srun_argv(spec.argv, options.nodes * options.tasks_per_node))
        limit = effective_time_min(options.time_min, options.extra)
        if warning := short_limit_warning(options.time_from, limit, options.signal_lead_s):
            append_note(paths.log, warning)
            logger.warning("job %s: %s", paths.dir.name, warning.removeprefix("trainq: "))
        atomic_write(paths.launch_spec, json_text(spec.to_dict()), mode=0o600)  # it holds the job's environment
        return paths, spec, options

    def _submit_one(self, paths: JobPaths, attempt: int, options: SlurmOptions) -> None:
        """slurm.sh, slurm.json, then sbatch in the worker; its answer is taken in ``_collect_answers``."""
        argv = options.argv(paths.slurm_script)
        atomic_write(
            paths.slurm_script,
            batch_script(paths, attempt, argv, self.python, self.package_parent, self._node_heartbeat_s()),
            mode=0o755,
        )
        record = {
            "attempt": attempt,
            "slurm_job_id": None,
            "tag": options.comment,
            "requeue": options.requeue,
            "submitted_at": iso_utc(time.time()),
            "sbatch": argv,
            "time_limit": options.time_from,
        }
        atomic_write_json(paths.slurm_record, record)  # before sbatch: a crash right after it can still find the job
        self._hand_over(Inflight(paths, attempt, options.comment, argv))

    def _submit_array(self, members: list[Held]) -> None:
        """One ``sbatch --array`` for a sweep's attempts: task ``i`` runs job ``<sweep>-i`` in its folder.

        Every member's slurm.sh is the array's script and its slurm.json names the array's tag and its index, so
        a crash or an unanswered sbatch is resolved for the whole array at once (``_resolve_unconfirmed``).
        """
        first = members[0]
        running = first.paths.dir.parent
        tag = make_array_tag(self.key, first.sweep, secrets.token_hex(4))
        spec = array_spec([m.index for m in members])
        options = dataclasses.replace(
            first.options,
            job_name=first.sweep,
            comment=tag,
            chdir=str(running),
            output=str(running / f"{first.sweep}-%a" / SLURM_OUTPUT.replace("%j", "%A_%a")),
            array=f"{spec}%{self.array_limit}" if self.array_limit else spec,
        )
        argv = options.argv(first.paths.slurm_script)
        script = array_script(
            running, first.sweep, first.attempt, argv, self.python, self.package_parent, self._node_heartbeat_s()
        )
        submitted_at = iso_utc(time.time())
        for member in members:
            atomic_write(member.paths.slurm_script, script, mode=0o755)
            record = {
                "attempt": member.attempt,
                "slurm_job_id": None,
                "tag": tag,
                "array_index": member.index,
                "requeue": options.requeue,
                "submitted_at": submitted_at,
                "sbatch": argv,
                "time_limit": options.time_from,
            }
            atomic_write_json(member.paths.slurm_record, record)
        self._hand_over(Inflight(first.paths, first.attempt, tag, argv, members))

    def _hand_over(self, sub: Inflight) -> None:
        key = str(sub.paths.dir)
        self._inflight[key] = sub
        members: list[Held] | list[Inflight] = sub.members or [sub]  # a sweep's array, or the one job
        for member in members:
            self._inflight_dirs[str(member.paths.dir)] = key
        self._submitter.submit(key, sub.argv)

    def _node_heartbeat_s(self) -> float | None:
        return None if self.heartbeat_s == HEARTBEAT_S else self.heartbeat_s  # the node's default needs no option

    def _submitting(self, paths: JobPaths) -> bool:
        """The attempt's sbatch is queued in the worker or running there."""
        return str(paths.dir) in self._inflight_dirs

    def _collect_answers(self) -> None:
        """Take the sbatch worker's answers: confirm, leave unconfirmed, or pass the error on to ``flush``.

        At most ANSWERS_BUDGET_S of work per call: a thousand answers that piled up during a long pass are taken
        over several passes, so the loop (and status.json) keep their pace.
        """
        budget_ends = time.monotonic() + ANSWERS_BUDGET_S
        while time.monotonic() < budget_ends:
            taken = self._submitter.take(1)
            if not taken:
                return
            key, answer = taken[0]
            sub = self._inflight.pop(key, None)
            if sub is None:
                continue
            members = sub.members or []
            try:
                slurm_id = self._answer(answer, sub.paths)
            except NoAnswer as exc:
                self._settle(sub)
                self._no_answer(sub, str(exc))
            except (SpawnFailed, ExecutorUnavailable) as exc:
                if len(members) > 1 and isinstance(exc, (SpawnFailed, SubmitLimited)):
                    # only the jobs Slurm itself refuses fail, and only those over a limit wait (an array's tail)
                    logger.warning(
                        "sweep %s: %s; submitting its %d jobs one by one", members[0].sweep, exc, len(members)
                    )
                    self._settle(sub)
                    for member in members:
                        self._submit_one(member.paths, member.attempt, member.options)
                else:
                    self._refused(sub, exc)
            else:
                self._settle(sub)
                self._answers += self._confirm_submission(sub, slurm_id)

    def _settle(self, sub: Inflight) -> None:
        members: list[Held] | list[Inflight] = sub.members or [sub]  # a sweep's array, or the one job
        for member in members:
            self._inflight_dirs.pop(str(member.paths.dir), None)

    def _refused(self, sub: Inflight, error: Exception) -> None:
        """sbatch said no (for now, or for good): slurm.json says so, so the tag is never looked for; the job
        stays "being submitted" until ``flush`` hands the error to the daemon."""
        members: list[Held] | list[Inflight] = sub.members or [sub]  # a sweep's array, or the one job
        for member in members:
            record = read_json(member.paths.slurm_record) or {}
            try:
                atomic_write_json(member.paths.slurm_record, {**record, "refused": str(error)})
            except OSError:
                pass  # the answer still reaches the daemon; a restart would look for the tag and find none
            self._answers.append((member.paths.dir.name, None, error))
            self._refused_dirs[member.paths.dir.name] = str(member.paths.dir)

    def _confirm_submission(self, sub: Inflight, slurm_id: str) -> list[tuple[str, str, None]]:
        if not sub.members:
            self._confirm(sub.paths, read_json(sub.paths.slurm_record) or {}, slurm_id)
            logger.debug("job %s: sbatch %s -> slurm job %s", sub.paths.dir.name, shlex.join(sub.argv[1:]), slurm_id)
            return [(sub.paths.dir.name, slurm_id, None)]
        first = sub.members[0]
        logger.info(
            "sweep %s: attempt %d of %d job(s) submitted as Slurm job array %s",
            first.sweep,
            first.attempt,
            len(sub.members),
            slurm_id,
        )
        confirmed = []
        for member in sub.members:
            task = array_task_id(slurm_id, member.index)
            self._confirm(member.paths, read_json(member.paths.slurm_record) or {}, task)
            confirmed.append((member.paths.dir.name, task, None))
        return confirmed

    def _no_answer(self, sub: Inflight, why: str) -> None:
        """sbatch got no answer: the job may exist; it is looked for by its tag before anything is submitted again."""
        if sub.members:
            logger.warning(
                "sweep %s: %s; looking for tag %s before submitting its array again", sub.members[0].sweep, why, sub.tag
            )
        else:
            logger.warning("job %s: %s; looking for tag %s before submitting again", sub.paths.dir.name, why, sub.tag)
        held: list[Held] | list[None] = sub.members or [None]
        for member in held:
            paths = member.paths if member else sub.paths
            self._unconfirmed[str(paths.dir)] = Unconfirmed(
                paths, sub.attempt, sub.tag, sub.argv, index=member.index if member else None
            )
        self._wake_poll()

    # -- sbatch options ------------------------------------------------------------------------
    def options_for(
        self, spec: LaunchSpec, job_name: str, job_slurm: dict, resources: dict | None = None, token: str | None = None
    ) -> SlurmOptions:
        """The attempt's sbatch options from its LaunchSpec, its resources, watcher.yaml and the job's slurm block."""
        if resources is None:
            resources = job_file(Path(spec.job_dir))[0]
        nodes = int(resources.get("nodes") or 1)
        gpus = int(resources.get("gpus_per_node") or resources.get("gpus") or 0)
        ram_gb = resources.get("ram_gb")
        time_min = time_limit_min(spec.timeout_s, spec.stop_grace_s, spec.kill_after_s)
        job_args = tuple(str(a) for a in job_slurm.get("sbatch_args") or ())
        extra = self.sbatch_args + job_args
        return SlurmOptions(
            job_name=job_name,
            partition=job_slurm.get("partition") or self.partition,
            gpus=gpus,
            mem_mb=math.ceil(float(ram_gb) * 1024) if ram_gb else None,
            time_min=time_min,
            chdir=spec.cwd,
            output=str(Path(spec.job_dir) / SLURM_OUTPUT),
            extra=extra,
            comment=make_tag(self.key, Path(spec.job_dir).name, spec.attempt, token or secrets.token_hex(4)),
            signal_lead_s=signal_lead_s(spec.stop_grace_s, spec.kill_after_s, effective_time_min(time_min, extra)),
            requeue=bool(job_slurm.get("requeue")),
            nodes=nodes,
            tasks_per_node=int(resources.get("tasks_per_node") or 1),
            node_env=self.node_env,
            time_from=time_limit_source(time_min, spec.timeout_s, self.sbatch_args, job_args),
        )

    # -- talking to Slurm ------------------------------------------------------------------------
    def _submit(self, argv: list[str], paths: JobPaths) -> str:
        """Run sbatch here (a resubmission after a tag lookup, rare): see ``_answer``."""
        try:
            done = run(argv, self.command_timeout_s, self.sbatch_env)
        except FileNotFoundError:
            raise self._went_down("sbatch is not on PATH; install the Slurm client or fix PATH") from None
        except subprocess.TimeoutExpired:
            raise NoAnswer(f"sbatch did not answer in {self.command_timeout_s:g} s") from None
        return self._answer(Answer(done.returncode, done.stdout, done.stderr), paths)

    def _answer(self, done: Answer, paths: JobPaths) -> str:
        """sbatch's answer: the id; ExecutorUnavailable when refused at the door, SubmitLimited for a QOS or
        association limit, NoAnswer when the job may exist anyway, SlurmRejected for a refusal that will stay."""
        if done.returncode is None:
            raise NoAnswer(done.stderr)
        if done.returncode == -1:
            raise self._went_down(done.stderr)
        first = first_line(done.stderr)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[-1].split(";")[0]
        if NO_ANSWER.search(done.stderr):
            raise NoAnswer(first)
        if REFUSED.search(done.stderr):
            raise self._went_down(first)
        said = (
            "; ".join(line.strip().removeprefix("sbatch: error: ") for line in done.stderr.splitlines() if line.strip())
            or f"sbatch exited {done.returncode}"
        )
        if LIMITED.search(done.stderr) and not PER_JOB_LIMIT.search(done.stderr):
            raise SubmitLimited(f"Slurm: {said}; submitting again in {self.limit_retry_s:g} s", self.limit_retry_s)
        # no path in the words: the job leaves running/ for failed/ with them (run.json says whose they are)
        if NODE_CONFIG.search(done.stderr):
            raise SlurmRejected(f"Slurm refused the job: {said}", RESOURCES_ADVICE)
        raise SlurmRejected(
            f"Slurm refused the job: {said}; fix slurm.partition / slurm.sbatch_args in the job file or watcher.yaml, "
            "then submit it again"
        )

    def _confirm(self, paths: JobPaths, record: dict, slurm_id: str) -> None:
        """The submission exists as ``slurm_id``: record it in slurm.json and track it."""
        # not fsynced: the tag written before sbatch (durably) finds the job again if this write is lost
        atomic_write_json(paths.slurm_record, {**record, "slurm_job_id": slurm_id}, durable=False)
        self._unconfirmed.pop(str(paths.dir), None)
        self._track(slurm_id, SlurmJob("PENDING", "None"))
        self._seeded.add(slurm_id)  # "PENDING" until squeue says otherwise: it may run and end before the next poll

    def _went_down(self, detail: str) -> ExecutorUnavailable:
        self._down = f"Slurm is not reachable: {detail}"
        logger.warning("slurm: %s", self._down)
        return ExecutorUnavailable(self._down)

    def _scancel(self, slurm_id: str, paths: JobPaths | None) -> None:
        """Cancel ``slurm_id`` with the others asked for this tick: one scancel for a whole cancelled sweep."""
        self._to_cancel.setdefault(slurm_id, paths.dir.name if paths else "duplicate")

    def _flush_cancels(self) -> None:
        """One ``scancel ID...`` for every Slurm job asked to be cancelled since the last one."""
        if not self._to_cancel:
            return
        batch, self._to_cancel = self._to_cancel, {}
        ids = sorted(batch, key=id_order)
        what = ids[0] if len(ids) == 1 else f"{len(ids)} jobs"
        try:
            done = run(["scancel", *ids], self.command_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            logger.warning("scancel of %s (%s) failed: %s", what, ", ".join(sorted(set(batch.values()))[:5]), exc)
            return
        if done.returncode != 0:
            logger.warning(
                "scancel %s: %s", " ".join(ids[:5]) + (" ..." if len(ids) > 5 else ""), first_line(done.stderr)
            )
            if REFUSED.search(done.stderr) or NO_ANSWER.search(done.stderr):
                return  # nothing was cancelled; a later stop check asks again
        self._cancelled.update(ids)  # scancel goes on past an id it cannot cancel (one that just ended)
