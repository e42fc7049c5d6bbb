"""A request on the watcher's jobs socket wakes one waiting pooled supervisor, not all of them (issue 38)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import wait_until

#: a waiting pooled supervisor's wait, alone: block in ``_Waiter``, then say what there was to take
WAITER = """
import os, socket, sys, time
from trainq.watcher.supervisor.pool import _Waiter
requests, jobs = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
waiter = _Waiter(requests, jobs)
print("waiting", flush=True)
direct = waiter.direct_request()
time.sleep(0.3)  # a supervisor woken for nothing would still find the request unread, and take it for its own
try:
    got = jobs.recv(100, socket.MSG_DONTWAIT).decode()
except BlockingIOError:
    got = "nothing"
print(f"woke direct={direct} got={got}", flush=True)
"""


def test_one_request_wakes_one_waiting_supervisor():
    watcher_end, pool_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    helper_r, helper_w = os.pipe()
    fds = (helper_r, pool_end.fileno())
    waiters = [
        subprocess.Popen(
            [sys.executable, "-c", WAITER, str(helper_r), str(pool_end.fileno())],
            pass_fds=fds,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for proc in waiters:
            assert proc.stdout.readline() == "waiting\n"
        time.sleep(0.2)  # each is in its epoll wait (a print comes just before it)
        watcher_end.send(b"job-1")
        wait_until(lambda: sum(p.poll() is not None for p in waiters) >= 1, 30, what="a waiter to wake")
        time.sleep(0.5)  # a second waiter woken by the same request would have ended by now
        ended = [p for p in waiters if p.poll() is not None]
        assert len(ended) == 1
        assert ended[0].stdout.read() == "woke direct=True got=job-1\n"
        watcher_end.send(b"job-2")  # the next request wakes another one
        wait_until(lambda: sum(p.poll() is not None for p in waiters) >= 2, 30, what="a waiter to wake")
        second = [p for p in waiters if p.poll() is not None and p is not ended[0]]
        assert second[0].stdout.read() == "woke direct=True got=job-2\n"
        os.write(helper_w, b"x")  # the helper's pipe wakes the last one, as a request it reads itself
        wait_until(lambda: all(p.poll() is not None for p in waiters), 30, what="a waiter to wake")
        last = next(p for p in waiters if p is not ended[0] and p is not second[0])
        assert last.stdout.read() == "woke direct=False got=nothing\n"
    finally:
        for proc in waiters:
            proc.kill()
            proc.wait()
        for fd in (helper_r, helper_w):
            os.close(fd)
        watcher_end.close()
        pool_end.close()


def test_a_request_comes_before_the_helpers_pipe():
    """Woken for a request, a supervisor takes it even when its pipe from the helper is readable too (the pool
    letting it go): read first, the pipe would leave the request to supervisors the kernel did not wake."""
    from trainq.watcher.supervisor.pool import _Waiter

    watcher_end, pool_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    helper_r, helper_w = os.pipe()
    try:
        waiter = _Waiter(helper_r, pool_end)
        os.close(helper_w)  # end of file on the pipe: the helper let this supervisor go
        helper_w = -1
        watcher_end.send(b"job-1")
        assert waiter.direct_request()
        assert pool_end.recv(100) == b"job-1"
        assert not waiter.direct_request()  # then the pipe
    finally:
        for fd in (helper_r, helper_w):
            if fd >= 0:
                os.close(fd)
        watcher_end.close()
        pool_end.close()
