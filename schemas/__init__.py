"""The JSON Schemas of the file contract (job, train, watcher, status, run); data files only."""
