"""A stand-in watcher: launches one supervisor from a LaunchSpec JSON file, prints its pid, sleeps until killed."""

import json
import sys
import time

from trainq.watcher.supervisor import LaunchSpec, Supervisor

spec = LaunchSpec.from_dict(json.loads(open(sys.argv[1]).read()))
print(Supervisor().launch(spec), flush=True)
while True:
    time.sleep(3600)
