"""The inference role: the worker loop (worker), rollouts from tasks to groups (rollout), the engines (engines/).
Never imports rlhpc.cluster or rlhpc.launch."""
