"""Child-side jobs, run in the training Python by worker.run_job. Stdlib + training stack only."""
