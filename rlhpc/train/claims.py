"""The trainer's side of the rollout queue: rank 0 claims each step's groups and keeps the ledger and the progress the
workers read; the other ranks wait for the same claim (rlhpc/transport/queue.py)."""

from __future__ import annotations

from typing import Callable, Dict, Optional

from rlhpc.config.schema import Config
from rlhpc.run.rundir import RunDir
from rlhpc.run.stop import Stop, stop_requested
from rlhpc.transport.queue import Claim, Queue


class Claims:
    def __init__(self, cfg: Config, run: RunDir, is_main: bool):
        self.cfg, self.run, self.is_main = cfg, run, is_main
        self.queue = Queue(run.queue, lease_s=cfg.queue.lease_s, keep_dropped=cfg.queue.keep_dropped,
                           keep_quarantined=cfg.queue.keep_quarantined)

    def start(self, step: int) -> None:
        """Rank 0, before the first step (`step` > 0 on resume): the ledger forgets steps not checkpointed."""
        self.queue.truncate_ledger(before_step=step)
        self.queue.set_progress(claimed=step, version=step)

    def claim(self, step: int, while_waiting: Callable[[], None] = lambda: None) -> Claim:
        """The groups of `step`; raises Stop when asked to stop while waiting for them. `while_waiting` runs between
        two looks at the queue."""
        def abort() -> Optional[str]:
            if stop_requested():
                raise Stop(stop_requested())
            while_waiting()
            return self.run.failure()

        timeout = self.cfg.trainer.rollout_timeout_s
        if not self.is_main:
            return self.queue.wait_claim(step, timeout, abort=abort, max_version=step)
        # Weights version `step` is the newest there is: a group claiming a newer one is left from before a restart.
        # Workers count the groups this claim holds so far (otherwise one would start a batch for a step already
        # covered: with async_level=0 it would be one version too old and dropped).
        claim = self.queue.claim(step, self.cfg.trainer.groups_per_step, step - self.cfg.async_level, timeout,
                                 abort=abort, max_version=step,
                                 on_progress=lambda have: self.queue.set_progress(step, step, claiming=have))
        self.queue.set_progress(claimed=step + 1, version=step)  # workers size their next batch by this
        return claim

    def trained(self, step: int, claim: Claim, skipped: Optional[str]) -> None:
        """Rank 0, once version step + 1 is published: the workers' progress, and the step in the ledger."""
        self.queue.set_progress(claimed=step + 1, version=step + 1)
        self.queue.record(step, claim, skipped=skipped)

    def sync(self) -> None:
        """Rank 0, before a checkpoint is written: the claims and ledger lines of the steps it covers become durable."""
        self.queue.sync()

    def retire_before(self, step: int) -> None:
        """Rank 0: files of steps before `step` are never read again (checkpointed, or no checkpoint to resume from)."""
        self.queue.retire_before(step, keep=self.cfg.queue.keep_retired)

    def stats(self, step: int, claim: Claim) -> Dict[str, float]:
        """The claimed rollouts, their staleness, and the queue's state."""
        b = claim.batch
        rewards = [r for g in b.groups for r in g.rewards]
        staleness = [step - g.version for g in b.groups]
        counts = self.queue.counts()
        comp = [n for g in b.groups for n in g.extra.get("completion_tokens", [])]
        return {
            "rollout/reward": sum(rewards) / len(rewards),
            "rollout/truncated_frac": sum(t for g in b.groups for t in g.truncated) / max(len(rewards), 1),
            "rollout/completion_tokens": sum(comp) / max(len(comp), 1),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": max(staleness),
            "async/dropped_groups": claim.dropped_groups,
            "queue/pending_files": counts["pending_files"],
            "queue/quarantined_files": counts["quarantined_files"],
            "perf/rollout_wait_s": claim.wait_s,
        }
