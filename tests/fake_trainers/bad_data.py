"""Reads a data file that is not JSON lines: dies of a real JSONDecodeError traceback (exit 1)."""

import json
import os

path = os.path.join(os.environ["TRAINQ_JOB_DIR"], "train.jsonl")
with open(path, "w") as f:
    f.write('{"text": "fine"}\n{not json\n')
with open(path) as f:
    rows = [json.loads(line) for line in f]
