"""trainq's watcher: turns job files dropped into ``queue/inbox/`` into supervised runs.

The watcher never imports the training stack; it talks to the trainer only through files.
"""

__version__ = "0.1.0"
