"""trainq's built-in trainer (``python -m trainq.trainer JOB_DIR``); the watcher never imports this package."""
