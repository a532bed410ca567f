"""Where a run executes: local (detached subprocess), torchrun, docker, slurm."""
