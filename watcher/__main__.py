"""``python -m trainq.watcher`` is the ``trainq`` command."""

import sys

from trainq.watcher.cli.main import main

sys.exit(main())
