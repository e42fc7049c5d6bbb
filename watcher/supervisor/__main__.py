"""``python -m trainq.watcher.supervisor JOB_DIR --spec FILE.json``: one attempt in the foreground (attempt.main)."""

import sys

from .attempt import main

sys.exit(main())
