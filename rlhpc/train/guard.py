"""Nothing non-finite trains: the checks that skip an optimizer step, and the count that stops a diverging run.

A step is skipped when its advantages, its loss or its gradient norm is not finite: the gradients are dropped and
neither the optimizer nor the LR schedule steps, so the weights stay those of version k. The step still happens in
every other respect: its groups are consumed (the ledger records the step once, as skipped, with the reason) and the
unchanged weights are published as version k+1. So "the weights after step k are version k+1" keeps holding, workers
waiting for version k+1 go on, and no group is trained twice. After `trainer.max_bad_steps` skipped steps in a row the
run stops: something upstream (the learning rate, the data, a loss) is broken, and skipping more would only burn the
allocation.
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional

import torch

from rlhpc.transport.queue import RolloutBatch

log = logging.getLogger(__name__)


class TooManyBadSteps(RuntimeError):
    """`trainer.max_bad_steps` steps in a row were skipped for non-finite values."""


def nonfinite_advantages(batch: RolloutBatch) -> Optional[str]:
    """Why the step cannot train on `batch` (its advantages are not all finite), or None."""
    bad = ~torch.isfinite(batch.advantages)
    if not bool(bad.any()):
        return None
    return f"{int(bad.sum())} non-finite advantage(s)"


def nonfinite_groups(batch: RolloutBatch) -> List[str]:
    """Uids of the groups with a non-finite advantage; every group of the step when none has one (a non-finite loss or
    gradient cannot be traced to one group)."""
    bad = ~torch.isfinite(batch.advantages)
    if bool(bad.any()):
        return sorted({batch.groups[i].uid for i in batch.group_of[bad].tolist()})
    return [g.uid for g in batch.groups]


def nonfinite_update(loss: float, grad_norm: float) -> Optional[str]:
    """Why the gradients of a step must not be applied (its loss or gradient norm is not finite), or None."""
    if not math.isfinite(loss):
        return f"loss {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm {grad_norm}"
    return None


class BadSteps:
    """Counts skipped steps; raises TooManyBadSteps after `max_in_a_row` in a row. Every trainer rank keeps one and
    reaches the same verdicts (the checked values are the same on all ranks), so all ranks stop together."""

    def __init__(self, max_in_a_row: int, report: bool = True):
        self.max_in_a_row = max_in_a_row
        self.report = report
        self.in_a_row = 0
        self.total = 0
        # Why the step just trained was skipped, or None when its update was applied.
        self.last: Optional[str] = None

    def applied(self) -> None:
        self.in_a_row, self.last = 0, None

    def skipped(self, step: int, reason: str, uids: List[str]) -> None:
        self.total += 1
        self.in_a_row += 1
        self.last = reason
        if self.report:
            log.warning("step %d skipped: %s; weights unchanged, republished as version %d (%d in a row, %d in all); "
                        "groups: %s", step, reason, step + 1, self.in_a_row, self.total, " ".join(uids))
        if self.in_a_row >= self.max_in_a_row:
            raise TooManyBadSteps(
                f"{self.in_a_row} optimizer steps in a row (steps {step - self.in_a_row + 1}..{step}) were skipped for "
                f"non-finite values (last: {reason}); stopping the run (trainer.max_bad_steps={self.max_in_a_row}). "
                f"The weights are those before the first skipped step. Look for the cause in logs/trainer-0.log "
                f"(the skipped steps list their groups); lower trainer.optim.lr or check algo.name and the "
                f"environment's rewards, then resume from the last checkpoint"
            )
