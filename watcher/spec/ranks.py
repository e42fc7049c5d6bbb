"""Rules for train jobs on several ranks and nodes that JSON Schema cannot say (docs/distributed.md).

``rank_problems`` reads the job file alone (processes against the GPUs asked for, fsdp with qlora, srun tasks);
``nodes_problem`` needs the watcher's executor: only Slurm spreads a job over several nodes.
"""

from __future__ import annotations

from trainq.watcher.spec.errors import Problem


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_problems(data: dict) -> list[Problem]:
    """Problems of a schema-valid job mapping's ``train.processes``/``strategy`` with its ``resources``."""
    train, resources = data.get("train"), data.get("resources")
    if not isinstance(train, dict):
        return []
    resources = resources if isinstance(resources, dict) else {}
    problems = []
    processes = _int(train.get("processes"))
    per_node = _int(resources.get("gpus_per_node"))
    gpus = per_node if per_node is not None else _int(resources.get("gpus"))
    if processes is not None and gpus and processes > gpus:
        field = "resources.gpus_per_node" if per_node is not None else "resources.gpus"
        problems.append(
            Problem(
                "train.processes",
                f"asks for {processes} ranks but {field} is {gpus}: each rank "
                f"trains on its own GPU; ask for {field}: {processes} or lower "
                "train.processes",
            )
        )
    if train.get("strategy") == "fsdp" and train.get("method") == "qlora":
        problems.append(
            Problem(
                "train.strategy",
                "fsdp does not support method: qlora (4-bit weights are not "
                "sharded); use strategy: ddp with qlora, or method: full with fsdp",
            )
        )
    tasks = _int(resources.get("tasks_per_node"))
    if tasks is not None and tasks > 1:
        problems.append(
            Problem(
                "resources.tasks_per_node",
                f"is {tasks}, but a train job runs one torchrun per node "
                "that starts the ranks itself; set train.processes "
                "for the ranks on each node and leave tasks_per_node out",
            )
        )
    return problems


def nodes_problem(data: dict, executor: str) -> Problem | None:
    """``resources.nodes`` above 1 on an executor that runs every job on this one machine."""
    resources = data.get("resources")
    nodes = _int(resources.get("nodes")) if isinstance(resources, dict) else None
    if nodes is None or nodes <= 1 or executor == "slurm":
        return None
    return Problem(
        "resources.nodes",
        f"is {nodes}, but this watcher's executor is {executor}: it runs a job on this "
        "one machine; set executor: slurm in watcher.yaml or ask for nodes: 1",
    )


def default_gpus(data: dict) -> int:
    """GPUs a job gets without ``resources.gpus`` on a machine that has GPUs: one per rank of a train job with
    ``train.processes`` (each rank trains on its own GPU), else 1."""
    train = data.get("train")
    processes = _int(train.get("processes")) if isinstance(train, dict) else None
    return processes if processes is not None and processes > 0 else 1
