"""trainq's built-in trainer (``python -m trainer JOB_DIR``); the watcher never imports this package."""
