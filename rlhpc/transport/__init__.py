"""How data moves between the roles: rollout groups through the filesystem queue (queue), weights by broadcast or
filesystem snapshot (weights)."""
