"""A test-only loss (`algo.name=poison_loss:nan_grpo`): GRPO whose loss is NaN for the first RLHPC_TEST_NAN_CALLS calls
in a process (all calls when unset), to test that a non-finite loss never reaches the optimizer."""

import os

from rlhpc.algo.loss import grpo

_calls = [0]


def nan_grpo(x, cfg):
    out = grpo(x, cfg)
    _calls[0] += 1
    limit = os.environ.get("RLHPC_TEST_NAN_CALLS")
    if limit is None or _calls[0] <= int(limit):
        out.token_loss = out.token_loss * float("nan")
    return out
