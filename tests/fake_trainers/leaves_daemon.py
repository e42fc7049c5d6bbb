"""Double-forks a daemon that ignores SIGTERM and sleeps, writes its pid, then exits 0 at once."""

import os
import signal
import time

pid_file = os.path.join(os.environ["TRAINQ_JOB_DIR"], "daemon.pid")
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        while True:
            time.sleep(3600)
    os._exit(0)
os.waitpid(middle, 0)
while not os.path.exists(pid_file):
    time.sleep(0.01)
print("main exits, daemon stays", flush=True)
