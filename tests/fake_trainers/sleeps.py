"""Says it is ready, then sleeps until killed; default SIGTERM handling (so SIGTERM ends it)."""

import time

print("ready", flush=True)
while True:
    time.sleep(3600)
