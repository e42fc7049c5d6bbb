"""One task of a multi-node job: node 0 serves MASTER_PORT, every task (node 0 too) connects to MASTER_ADDR.

Prints ``rank R of W on HOST (node N of M): master ADDR answered from HOST0``, proving that the name in MASTER_ADDR
resolves on every node and that the first node is reachable from each of them.
"""

from __future__ import annotations

import os
import socket
import threading
import time

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
node, nodes = int(os.environ["NODE_RANK"]), int(os.environ["NNODES"])
master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
host = socket.gethostname()


def serve(server: socket.socket) -> None:
    for _ in range(world):
        conn, _ = server.accept()
        with conn:
            conn.sendall(host.encode())


if node == 0:
    server = socket.create_server(("", port))
    serving = threading.Thread(target=serve, args=(server,), daemon=True)
    serving.start()
deadline = time.monotonic() + 120
while True:
    try:
        with socket.create_connection((master, port), timeout=5) as conn:
            answer = conn.recv(100).decode()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
print(f"rank {rank} of {world} on {host} (node {node} of {nodes}): master {master} answered from {answer}", flush=True)
if node == 0:
    serving.join(120)  # until every task has had its answer
