"""The run's basics, used by every role and command: the run directory (rundir.py), processes and ports (procs.py), a
role's identity, local or from Slurm (identity.py, slurm_identity.py), stop signals (stop.py), Slurm job states
(slurm_jobs.py), metrics and the summary (metrics.py, summary.py), the held-out evaluation's bookkeeping
(evaluation.py) and the threads lent between roles of one machine (cores.py)."""
