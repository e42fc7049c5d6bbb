"""Prints numbered lines the hard way, for the log streams of `trainq serve`.

Each line is "line A-I ünï" once cleaned (A the attempt, I from 1), but written as a terminal
program writes it: in colour (ANSI escapes), every third and seventh line in two writes with a pause
in between (cut inside an escape, inside a character), every fifth ended by CRLF; a progress bar redraws itself with lone CRs before line 2.
With --metrics, a step record goes to $TRAINQ_METRICS after each line.

    chatty.py --lines N [--delay S] [--fail-first-after K] [--gates H1,H2] [--metrics]

--fail-first-after K: attempt 1 prints K lines, then exits 3 (the watcher retries it).
--gates H: after line H, wait until the file $TRAINQ_JOB_DIR/go-H exists (the test says when).
"""

import argparse
import json
import os
import sys
import time

args = argparse.ArgumentParser()
args.add_argument("--lines", type=int, required=True)
args.add_argument("--delay", type=float, default=0.0)
args.add_argument("--fail-first-after", type=int, default=0)
args.add_argument("--gates", default="")
args.add_argument("--metrics", action="store_true")
opts = args.parse_args()
attempt = int(os.environ.get("TRAINQ_ATTEMPT", "1"))
job_dir = os.environ["TRAINQ_JOB_DIR"]
gates = {int(g) for g in opts.gates.split(",") if g}
out = sys.stdout.buffer


def write(data: bytes) -> None:
    out.write(data)
    out.flush()


def line(i: int) -> None:
    text = f"\x1b[1;32mline {attempt}-{i}\x1b[0m ünï".encode()
    end = b"\r\n" if i % 5 == 0 else b"\n"
    cut = 4 if i % 3 == 0 else text.index("ü".encode()) + 1 if i % 7 == 0 else 0
    if cut:
        write(text[:cut])
        time.sleep(0.05)  # the reader sees half a line, cut inside an escape or inside a character
        write(text[cut:] + end)
    else:
        write(text + end)


for i in range(1, opts.lines + 1):
    if i == 2:
        for pct in (0, 50, 100):
            write(f"progress {pct}%\r".encode())
        write(b"\n")
    line(i)
    if opts.metrics:
        with open(os.environ["TRAINQ_METRICS"], "a") as f:
            f.write(
                json.dumps(
                    {"type": "step", "step": i, "total_steps": opts.lines, "loss": 10.0 / i, "time": time.time()}
                )
                + "\n"
            )
    if attempt == 1 and i == opts.fail_first_after:
        sys.exit(3)
    if i in gates:
        while not os.path.exists(os.path.join(job_dir, f"go-{i}")):
            time.sleep(0.02)
    time.sleep(opts.delay)
