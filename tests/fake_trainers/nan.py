"""Computes a loss that really overflows to inf, reports it, exits 1 (or the code given as argv[1])."""

import math
import sys

loss = 2.0
for step in range(1, 4):
    loss = loss * 1e200  # 2e200, then inf
    print(f"step {step}: loss {loss:.4f}", flush=True)
    if not math.isfinite(loss):
        print(f"step {step}: loss is {loss}; stopping", flush=True)
        sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
