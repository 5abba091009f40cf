"""The trainer role: the RL loop (trainer), the SFT warm start (warmstart), the optimizer (optim), FSDP2 (parallel),
micro-batches and logprobs (batching), checkpoints (checkpoint). Never imports rlhpc.cluster or rlhpc.launch."""
