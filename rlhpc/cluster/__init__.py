"""Cluster helpers: bring a real single-machine Slurm cluster up and down (``python -m rlhpc.cluster.local``)."""
