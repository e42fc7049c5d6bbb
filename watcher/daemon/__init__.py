"""The watcher's loop and its steps: admission, starting, finishing, recovery, the executor interface."""
