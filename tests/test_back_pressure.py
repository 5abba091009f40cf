"""A worker's back-pressure decision (rlhpc.infer.worker.back_pressure): it generates while the queue is short and its
weights are fresh enough for the step its groups will feed, and waits otherwise, saying why."""

from rlhpc.infer.worker import back_pressure

PER_STEP, MAX_PENDING = 8, 2


def decide(pending_groups, claimed, version, async_level=1):
    return back_pressure(pending_groups, claimed, version, PER_STEP, MAX_PENDING, async_level)


def test_a_worker_with_fresh_weights_and_a_short_queue_generates():
    assert decide(pending_groups=0, claimed=5, version=5) is None
    assert decide(pending_groups=PER_STEP, claimed=5, version=5) is None  # feeds step 6, one step ahead: allowed


def test_a_worker_waits_once_the_queue_holds_max_pending_steps_of_groups():
    why = decide(pending_groups=MAX_PENDING * PER_STEP, claimed=5, version=5)
    assert why is not None and "queue.max_pending_steps=2" in why
    assert decide(pending_groups=MAX_PENDING * PER_STEP - 1, claimed=5, version=5) is None


def test_a_worker_waits_when_its_weights_are_too_old_for_the_step_its_groups_feed():
    why = decide(pending_groups=0, claimed=5, version=3)  # step 5 accepts weights of version 4 and newer
    assert why is not None and "version 3 is too old for step 5" in why
    assert decide(pending_groups=0, claimed=5, version=4) is None


def test_fully_synchronous_workers_generate_only_for_the_step_their_weights_made():
    assert decide(pending_groups=0, claimed=5, version=5, async_level=0) is None
    assert decide(pending_groups=PER_STEP, claimed=5, version=5, async_level=0) is not None  # would feed step 6


def test_groups_in_flight_short_of_a_step_do_not_move_the_target_step():
    assert decide(pending_groups=PER_STEP - 1, claimed=5, version=5, async_level=0) is None
