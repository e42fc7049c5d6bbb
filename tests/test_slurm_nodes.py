"""Several Slurm nodes on one machine: ``TRAINQ_SLURM_NODES=3 tests/slurm/start.sh``.

Each node (node1, node2, node3) is a slurmd in its own network and UTS namespace, with its own host name and its own
address on a bridge (10.213.0.K), sharing the filesystem and munge with the controller on this machine. Jobs that
span nodes really run once per host: separate names, separate network stacks, a rendezvous over the bridge.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import drop, tick_until
from test_slurm import (  # noqa: F401  (the autouse clean-up fixture is used by name)
    SLURM,
    SLURM_DIR,
    finished,
    job_file,
    no_leftover_slurm_jobs,
    run_json,
    use_cluster,
)

pytestmark = pytest.mark.slurm

#: nodes in this module's cluster: enough for a 3-node job, and a 2-node job leaves one idle
NODES = 3
#: the network start.sh gives the nodes (the bridge's own address is .254)
NET = "10.213.0"


@pytest.fixture(scope="module", autouse=True)
def nodes_cluster():
    """The cluster with NODES nodes for this module (the next Slurm module's start switches back to one)."""
    yield from use_cluster({"TRAINQ_SLURM_NODES": str(NODES)})


def _sh(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)


def restart_nodes(nodes: int = NODES) -> subprocess.CompletedProcess:
    """tests/slurm/start.sh again, for ``nodes`` nodes without accounting: a test that switched or broke the
    cluster puts it back this way."""
    env = dict(os.environ, TRAINQ_SLURM_NODES=str(nodes), TRAINQ_SLURM_ACCOUNTING="0")
    return _sh("bash", str(SLURM_DIR / "start.sh"), env=env)


def _node_lines(log: str, prefix: str) -> list[str]:
    return sorted(line for line in log.splitlines() if line.startswith(prefix))


def test_every_node_is_idle_with_its_own_name_address_and_view_of_the_others():
    listed = _sh("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %T").stdout.split("\n")
    assert [line for line in listed if line] == [f"node{k} idle" for k in range(1, NODES + 1)], listed
    show = 'echo "$(hostname) $SLURM_NODEID $(hostname -I) $(getent hosts node1 node2 node3 | tr -s " \\n" " ")"'
    ran = _sh("srun", f"-N{NODES}", "--ntasks-per-node=1", "sh", "-c", show)
    assert ran.returncode == 0, ran.stderr
    everyone = f"{NET}.1 node1 {NET}.2 node2 {NET}.3 node3"
    assert sorted(" ".join(line.split()) for line in ran.stdout.strip().splitlines()) == [
        f"node{k} {k - 1} {NET}.{k} {everyone}" for k in range(1, NODES + 1)
    ]
    # the machine itself keeps its own name
    assert _sh("hostname").stdout.strip() != "node1"


def test_a_command_job_on_two_nodes_runs_once_on_each_with_its_rendezvous(queue_dir, watcher):
    w = watcher(**SLURM)
    show = "echo host=$(hostname) node=$NODE_RANK/$NNODES rank=$RANK/$WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT"
    drop(queue_dir, "two.yaml", job_file(command=["sh", "-c", show], resources={"nodes": 2}))
    done = tick_until(w, lambda: finished(queue_dir, "two"), 120, "the 2-node job to finish")
    log = (done / "output.log").read_text()
    assert done.parent.name == "done", log
    port = 20000 + int(run_json(done)["slurm_job_id"]) % 20000
    assert _node_lines(log, "host=") == [
        f"host=node1 node=0/2 rank=0/2 master=node1:{port}",
        f"host=node2 node=1/2 rank=1/2 master=node1:{port}",
    ]


def test_a_command_job_on_three_nodes_reaches_its_master_from_every_node(queue_dir, watcher):
    """Every rank connects to a port the first node listens on, by the name MASTER_ADDR gives."""
    w = watcher(**SLURM)
    probe = Path(__file__).with_name("fake_trainers") / "rendezvous_probe.py"
    drop(
        queue_dir,
        "three.yaml",
        job_file(command=[sys.executable, str(probe)], resources={"nodes": 3}),
    )
    done = tick_until(w, lambda: finished(queue_dir, "three"), 180, "the 3-node job to finish")
    log = (done / "output.log").read_text()
    assert done.parent.name == "done", log
    assert _node_lines(log, "rank ") == [
        "rank 0 of 3 on node1 (node 0 of 3): master node1 answered from node1",
        "rank 1 of 3 on node2 (node 1 of 3): master node1 answered from node1",
        "rank 2 of 3 on node3 (node 2 of 3): master node1 answered from node1",
    ]


def test_switching_the_node_count_leaves_nothing_of_the_old_cluster_behind():
    """Down to two nodes, then stopped, then back to three: namespaces, links, bridge and /etc/hosts follow."""
    try:
        started = restart_nodes(2)
        assert started.returncode == 0, started.stderr
        assert _sh("sinfo", "-h", "-N", "-p", "debug", "-o", "%N").stdout.split() == ["node1", "node2"]
        assert sorted(p.name for p in Path("/run/netns").glob("trainq-node*")) == ["trainq-node1", "trainq-node2"]
        assert "node3" not in Path("/etc/hosts").read_text()
        stopped = _sh("bash", str(SLURM_DIR / "stop.sh"))
        assert stopped.returncode == 0, stopped.stderr
        assert not list(Path("/run/netns").glob("trainq-node*"))
        links = _sh("ip", "-o", "link", "show").stdout
        assert "trainq-" not in links, links
        assert "trainq tests/slurm/start.sh" not in Path("/etc/hosts").read_text()
        assert not list(Path(os.environ.get("TRAINQ_SLURM_DIR", "/run/trainq-test-slurm")).glob("slurmd*.pid"))
    finally:
        again = restart_nodes()
    assert again.returncode == 0, again.stderr
    assert len(_sh("sinfo", "-h", "-N", "-p", "debug", "-o", "%N").stdout.split()) == NODES
