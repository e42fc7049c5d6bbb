"""The file contract: what a job, a watcher.yaml, a queue folder is; errors, units, atomic writes."""
