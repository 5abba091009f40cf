"""The trainer role: the RL loop (trainer), claiming steps from the queue (claims), one optimizer step (step), the
weights stream and its sender (publish), held-out evaluation (evaluation), the SFT warm start (warmstart), the
optimizer (optim), FSDP2 (parallel), sharded loading (loading), micro-batches and logprobs (batching), checkpoints
(checkpoint), the step guard (guard), the Hugging Face export (export). Never imports rlhpc.cluster or rlhpc.launch."""
