"""``python -m trainq.watcher.supervisor JOB_DIR --spec FILE.json``: one attempt in the foreground (foreground.main)."""

import sys

from .foreground import main

sys.exit(main())
