"""A node that went silent under srun: end the attempt at once instead of waiting for Slurm to declare it dead.

Under srun (``resources.nodes`` > 1) one rank that fails makes srun end the others (``--kill-on-bad-exit``),
which takes about a second where every node answers. A node whose link is cut (or whose host hung) cannot
answer: its ranks give up after the collective timeout like everyone else's, but srun waits for that node's
slurmstepd until slurmctld declares the node dead (``SlurmdTimeout``: 300 s by default, then its ping
interval), minutes after the job's fate was sealed. ``SilentNodeWatch`` runs beside the node-side supervisor on
the batch host: once a rank's own exit record (ranks.py) says it failed and srun is still running
``SRUN_END_GRACE_S`` later, it asks every other node's slurmd for a TCP connection; the nodes that do not accept
one within ``PROBE_TIMEOUT_S`` went silent. Then, and only then, it ends srun (SIGKILL: srun itself would wait
for them) and the exit record carries the failed rank's own code, ``silent_nodes`` and a diagnosis naming them.
Where every node answers, srun is left to finish its own clean-up, and the probe is made again each grace.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from trainq.watcher.slurm.ranks import amended_by_rank, rank_records_with_hosts
from trainq.watcher.spec.contract import EVENT_RANK_FAILED, JobPaths
from trainq.watcher.spec.fsutil import append_line
from trainq.watcher.spec.records import read_metrics_tail
from trainq.watcher.spec.units import iso_utc

#: seconds srun gets to end the other ranks after one rank recorded a failure before the nodes are probed
#: (--kill-on-bad-exit ends the tasks of nodes that answer within about a second)
SRUN_END_GRACE_S = 5.0
#: seconds a node's slurmd has to accept a TCP connection before the node counts as silent
PROBE_TIMEOUT_S = 3.0
#: slurmd's port where ``scontrol show config`` does not say (Slurm's default)
DEFAULT_SLURMD_PORT = 6818
#: how often the watch looks at the ranks' exit records (s)
LOOK_S = 1.0
#: the diagnosis kind of a node that went silent: a node failure, as when Slurm itself says NODE_FAIL
SILENT_KIND = "preempted"


class SilentNodeWatch:
    """A daemon thread on the batch host of an srun attempt; ``amend`` puts what it did into the exit record."""

    def __init__(self, paths: JobPaths, attempt: int, env: dict[str, str] | os._Environ):
        self.paths, self.attempt = paths, attempt
        self.nodelist = env.get("SLURM_JOB_NODELIST", "")
        self.here = socket.gethostname()
        self.ended: dict | None = None  # set once srun was ended: the fields the exit record gains
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainq-silent-nodes", daemon=True)

    def start(self) -> SilentNodeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 1)

    def amend(self, record: dict) -> dict:
        """The supervisor's exit record, or (srun ended here) the failed rank's own code and the silent nodes."""
        if self.ended is None:
            return record
        rank, status = self.ended["failed_rank"], self.ended["rank_exit_code"]
        amended = amended_by_rank(record, rank, status)
        return dict(
            amended,
            silent_nodes=self.ended["silent_nodes"],
            executor_diagnosis={"kind": SILENT_KIND, "evidence": self.ended["evidence"]},
        )

    def _run(self) -> None:
        failed_at: float | None = None
        probe_at = 0.0
        while not self._stop.wait(LOOK_S):
            failure = first_failure(self.paths, self.attempt)
            if failure is None:
                continue
            now = time.monotonic()
            if failed_at is None:
                failed_at, probe_at = now, now + SRUN_END_GRACE_S
            if now < probe_at:
                continue
            srun = srun_process()
            if srun is None:
                return  # srun ended by itself: nothing to do
            nodes = node_addresses(self.nodelist, self.here)
            silent = {name: why for name, (addr, port) in nodes.items() if (why := no_answer(addr, port)) is not None}
            if not silent:
                probe_at = time.monotonic() + SRUN_END_GRACE_S
                continue
            failure = first_failure(self.paths, self.attempt, besides=set(silent)) or failure
            self._end_srun(srun, failure, silent, time.monotonic() - failed_at)
            return

    def _end_srun(
        self, srun: psutil.Process, failure: tuple[float, int, int, str], silent: dict[str, str], waited: float
    ) -> None:
        _, rank, status, host = failure
        rank_at = f"rank {rank}" + (f" on {host}" if host else "")
        names = ", ".join(sorted(silent))
        said = "; ".join(f"{name}: {why}" for name, why in sorted(silent.items()))
        ranks_said = last_rank_event(self.paths.metrics, set(silent))
        # short enough for a diagnosis (300 characters) to keep the start of what the ranks said
        evidence = (
            f"node{'s' if len(silent) > 1 else ''} {names} went silent ({said}; {waited:.0f} s after {rank_at} "
            f"exited {status}); trainq ended srun instead of waiting for SlurmdTimeout"
            + (f"; the ranks said: {ranks_said}" if ranks_said else "")
        )
        note(
            self.paths.log,
            f"trainq: {rank_at} exited {status} and srun was still waiting {waited:.0f} s later for the task"
            f"{'s' if len(silent) > 1 else ''} on {names}, whose slurmd did not answer from {self.here} ({said}): "
            f"{names} went silent; srun would wait until Slurm declares {'them' if len(silent) > 1 else 'it'} dead "
            f"(SlurmdTimeout), so trainq ends srun now",
        )
        self.ended = {
            "failed_rank": rank,
            "rank_exit_code": status,
            "silent_nodes": sorted(silent),
            "evidence": evidence,
        }
        note(self.paths.log, f"trainq: sending SIGKILL to srun (pid {srun.pid}) at {iso_utc(time.time())}")
        try:
            srun.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def first_failure(
    paths: JobPaths, attempt: int, besides: frozenset[str] | set[str] = frozenset()
) -> tuple[float, int, int, str] | None:
    """(time, rank, exit status, host) of the first rank of ``attempt`` that recorded a failure, or None; ``besides``:
    not one on these hosts (a silent node's rank may still reach a shared folder, but it only gave up waiting)."""
    return next((r for r in rank_records_with_hosts(paths, attempt) if r[2] != 0 and r[3] not in besides), None)


def srun_process() -> psutil.Process | None:
    """The attempt's srun: a child of the supervisor (this process) named srun, while it lives."""
    try:
        return next((p for p in psutil.Process().children() if p.name() == "srun"), None)
    except psutil.Error:
        return None


def node_addresses(nodelist: str, here: str) -> dict[str, tuple[str, int]]:
    """Every node of the allocation but this one: name -> (NodeAddr, slurmd's port), as ``scontrol`` says."""
    port = slurmd_port()
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", nodelist], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.splitlines():
        name, addr = re.search(r"NodeName=(\S+)", line), re.search(r"NodeAddr=(\S+)", line)
        if name and name[1] != here:
            found[name[1]] = (addr[1] if addr else name[1], port)
    return found


def slurmd_port() -> int:
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_SLURMD_PORT
    found = re.search(r"^SlurmdPort\s*=\s*(\d+)", out, re.MULTILINE)
    return int(found[1]) if found else DEFAULT_SLURMD_PORT


def no_answer(addr: str, port: int) -> str | None:
    """None when ``addr:port`` accepts a TCP connection within PROBE_TIMEOUT_S, else why not, in words."""
    try:
        with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT_S):
            return None
    except TimeoutError:
        return f"no answer from {addr}:{port} within {PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"{addr}:{port}: {exc.strerror or exc}"


def last_rank_event(metrics: Path, silent: set[str]) -> str | None:
    """The evidence of the last ``rank_failed`` event in metrics.jsonl (what the ranks' torchrun agents said),
    preferring one written on a node that still answers (it names its host: "rank 0 (pid N on node1)")."""
    said = [
        str(record["evidence"])
        for record in read_metrics_tail(metrics, 64 * 1024)
        if record.get("event") == EVENT_RANK_FAILED and record.get("evidence")
    ]
    answering = [e for e in said if not any(f" on {name})" in e for name in silent)]
    chosen = answering or said
    return chosen[-1] if chosen else None


def note(log: Path, line: str) -> None:
    if not append_line(log, line):
        print(f"trainq: cannot write {log}", file=sys.stderr)
