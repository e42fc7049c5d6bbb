"""``python -m trainq.watcher`` is the ``trainq`` command."""
import sys

from .cli import main

sys.exit(main())
