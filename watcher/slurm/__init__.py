"""The Slurm executor: submission, Slurm's answers, and the node's side of an attempt."""
