"""rlhpc: Slurm-native asynchronous reinforcement learning for large language models."""

__version__ = "0.1.0"
