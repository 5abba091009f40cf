"""The weights group's members come and go: a member killed mid-run leaves a group that goes on with those alive, and
a restarted member (same rank) or an attached one (a new rank, any launch attempt) joins at the next update, while
the trainer's publish never waits longer than one call for answers."""

import logging
import os
import signal
import sys
import time
import traceback

import pytest
import torch

from rlhpc.run.rundir import RunDir
from rlhpc.transport.weights import CALL_WAIT_S, BroadcastReceiver, BroadcastSender
from test_weights import CTX


def _follower(run_root, member, attempt, out):
    """An inference-side process that reports every update it receives, until the trainer closes the group."""
    try:
        recv = BroadcastReceiver(RunDir(run_root), member, timeout_s=60, attempt=attempt)
        while not recv.closed():
            update = recv.poll()
            if update is not None:
                out.put(("got", member, update.version, sum(t.double().sum().item() for _, t in update.tensors)))
            recv.wait(0.05)
        out.put(("closed", member))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", member, f"{type(e).__name__}: {e}", traceback.format_exc()))


class Reports:
    """The followers' reports. Each process writes to a queue of its own: a process killed or stopped while its queue's
    feeder thread holds the queue's write lock would otherwise silence every other process writing to that queue."""

    def __init__(self):
        self.queues, self.backlog = [], []

    def new_queue(self):
        self.queues.append(CTX.Queue())
        return self.queues[-1]

    def drain(self, timeout_s=0.5):
        """The reports that arrive within `timeout_s` (returns early once some arrived)."""
        deadline = time.time() + timeout_s
        while True:
            for q in self.queues:
                while True:
                    try:
                        self.backlog.append(q.get_nowait())
                    except Exception:  # noqa: BLE001 - queue.Empty
                        break
            if self.backlog or time.time() >= deadline:
                got, self.backlog = self.backlog, []
                return got
            time.sleep(0.02)

    def get(self, timeout):
        got = self.drain(timeout)
        assert got, f"no report within {timeout}s"
        self.backlog = got[1:]
        return got[0]


def start(run_root, member, out, attempt="t"):
    p = CTX.Process(target=_follower, args=(run_root, member, attempt, out.new_queue()), daemon=True)
    p.start()
    return p


def weights(version):
    g = torch.Generator().manual_seed(version)
    return [("model.a.weight", torch.randn(300, 200, generator=g)), ("model.b.bias", torch.randn(77, generator=g)),
            ("lm_head.weight", torch.randn(500, 64, generator=g).to(torch.bfloat16))]


def checksum(version):
    return sum(t.double().sum().item() for _, t in weights(version))


def reported(out, expected, timeout_s=60):
    """Waits for the report `expected` (a prefix of it); returns every report seen meanwhile."""
    seen, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        seen += out.drain(0.5)
        if any(tuple(r[:len(expected)]) == expected for r in seen):
            return seen
    raise AssertionError(f"no report {expected} within {timeout_s}s: {seen}")


def published(sender, version):
    t0 = time.monotonic()
    sender.publish(version, weights(version))
    return time.monotonic() - t0


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_the_group_goes_on_without_a_dead_member_and_admits_restarted_and_attached_ones(tmp_path):
    run = RunDir(tmp_path).make()
    out = Reports()
    procs = {m: start(str(tmp_path), m, out) for m in (1, 2)}
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=20)
    published(sender, 1)
    got = [out.get(timeout=60) for _ in range(2)]
    assert sorted(g[1:3] for g in got) == [(1, 1), (2, 1)], got
    assert all(abs(g[3] - checksum(1)) < 1e-6 * abs(checksum(1)) for g in got)

    os.kill(procs[2].pid, signal.SIGKILL)  # member 2 dies, as when its node goes
    procs[2].join(timeout=10)
    failing, calling = published(sender, 2), published(sender, 3)  # the failure shows, then a call forms a group of one
    slowest = max(failing, calling)
    print(f"after a member died: update {failing:.2f} s, the next (a call of the others) {calling:.2f} s")
    assert slowest < CALL_WAIT_S + 30  # one call's wait for the dead member's answer, not a timeout (20 s, 60 s)
    assert sender.members == [1]
    reported(out, ("got", 1, 3))

    # Member 2 starts again (a restart keeps its rank) and member 7 attaches from another launch (attempt unknown).
    procs[2] = start(str(tmp_path), 2, out)
    procs[7] = start(str(tmp_path), 7, out, attempt=None)
    deadline = time.time() + 60
    while not all(sender.store.check([f"join/{m}"]) for m in (2, 7)):  # both have presented the token
        assert time.time() < deadline, "the new members did not claim their ranks"
        time.sleep(0.05)
    joining = published(sender, 4)
    print(f"two members joining: update {joining:.2f} s")
    assert joining < CALL_WAIT_S + 30
    assert sender.members == [1, 2, 7]
    published(sender, 5)
    sender.close()
    # Each reports what it received, then "closed". `poll` hands over the newest update, so a member that was slow to
    # look may report version 5 without 4; every member must end at 5.
    reports, deadline = [], time.time() + 120
    while {r[1] for r in reports if r[0] in ("closed", "error")} != {1, 2, 7}:
        assert time.time() < deadline, reports
        reports += out.drain(0.5)
    errors = [r for r in reports if r[0] == "error"]
    assert not errors, errors
    for member in (1, 2, 7):
        versions = [r[2] for r in reports if r[0] == "got" and r[1] == member]
        assert versions in ([4, 5], [5]), (member, reports)
    for r in reports:
        if r[0] == "got":
            assert abs(r[3] - checksum(r[2])) < 1e-6 * abs(checksum(r[2]))
    for p in procs.values():
        p.join(timeout=30)
        assert p.exitcode == 0 or p.exitcode == -signal.SIGKILL


def _leaving_follower(run_root, member, out):
    """A member whose worker ends after its first update (a stop, the end of its work): it closes its receiver."""
    try:
        recv = BroadcastReceiver(RunDir(run_root), member, timeout_s=60, attempt="t")
        while recv.poll() is None:
            recv.wait(0.05)
        recv.close()
        out.put(("left", member))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", member, f"{type(e).__name__}: {e}", traceback.format_exc()))


def test_a_member_whose_worker_ends_is_no_fault_and_not_waited_for(tmp_path, caplog):
    """A worker that ends (a stop reaches the workers before the trainer, or it ran out of work) leaves the group
    between two updates: the send that fails on its closed connections reads as its leaving, not as a failure (gloo's
    'Connection reset by peer' is not logged), and the next epoch forms of the others without waiting for it."""
    run = RunDir(tmp_path).make()
    out = Reports()
    stays = start(str(tmp_path), 1, out)
    leaves = CTX.Process(target=_leaving_follower, args=(str(tmp_path), 2, out.new_queue()), daemon=True)
    leaves.start()
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=20)
    with caplog.at_level(logging.INFO, logger="rlhpc.transport.weights"):
        published(sender, 1)
        reported(out, ("left", 2))
        leaves.join(timeout=30)
        took = [published(sender, v) for v in (2, 3, 4)]
        print(f"after a member left: updates {', '.join(f'{t:.2f}' for t in took)} s")
        assert sender.members == [1]
        reported(out, ("got", 1, 4))
        sender.close()
    reported(out, ("closed", 1))
    stays.join(timeout=30)
    assert stays.exitcode == 0 and leaves.exitcode == 0
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "rlhpc.transport.weights"]
    assert not [r for r in records if r[0] != "INFO"], records
    assert any("members [2] left while version" in m for _, m in records), records


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_member_that_stalls_costs_the_member_timeout_once(tmp_path):
    """A member stopped (SIGSTOP: alive, silent) holds a broadcast at most weights.member_timeout_s; the group goes on
    without it."""
    run = RunDir(tmp_path).make()
    out = Reports()
    procs = {m: start(str(tmp_path), m, out) for m in (1, 2)}
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=3)
    big = [("w", torch.ones(8 << 20))]  # 32 MiB: fills the socket buffers, so a stalled member blocks the send
    sender.publish(1, big)
    assert sorted(g[1:3] for g in (out.get(timeout=60) for _ in range(2))) == [(1, 1), (2, 1)]
    os.kill(procs[2].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        sender.publish(2, big)
        sender.publish(3, big)
        took = time.monotonic() - t0
        print(f"a stopped member (member timeout 3 s): two updates {took:.2f} s")
        assert sender.members == [1]
        assert took < 3 + CALL_WAIT_S + 30, took  # one member timeout and one call, not weights.timeout_s
        reported(out, ("got", 1, 3))
    finally:
        os.kill(procs[2].pid, signal.SIGKILL)
        sender.close()
        for p in procs.values():
            p.join(timeout=30)


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
@pytest.mark.parametrize("n", [1])
def test_nothing_to_send_to_is_no_error(tmp_path, n):
    """Every member gone: updates are taken and dropped until one joins again."""
    run = RunDir(tmp_path).make()
    out = Reports()
    p = start(str(tmp_path), n, out)
    sender = BroadcastSender(run, num_receivers=1, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=20)
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    for v in (1, 2, 3):
        sender.publish(v, weights(v))
    assert sender.members == []
    p = start(str(tmp_path), n, out)
    deadline = time.time() + 60
    while not sender.store.check([f"join/{n}"]):
        assert time.time() < deadline
        time.sleep(0.05)
    sender.publish(4, weights(4))
    assert out.get(timeout=60)[:3] == ("got", n, 4)
    sender.close()
    assert out.get(timeout=60) == ("closed", n)
    p.join(timeout=30)


def big_weights(version):
    """Eight 1 MiB tensors (fp32) and one bf16: with 1 MiB buckets, nine buckets."""
    g = torch.Generator().manual_seed(100 + version)
    return [(f"model.layers.{i}.w", torch.randn(256, 1024, generator=g)) for i in range(8)] + [
        ("lm_head.weight", torch.randn(64, 1024, generator=g).to(torch.bfloat16))]


def _in_place_follower(run_root, member, out, hold_s):
    """A worker whose receiver loads in place: its "engine" is a dict of tensors; each "generation" holds the gate for
    `hold_s` and checks that the weights did not change under it."""
    try:
        model = {n: torch.zeros_like(t) for n, t in big_weights(0)}

        def load(parts):
            for name, t in parts:
                model[name].copy_(t)

        def total():
            return sum(t.double().sum().item() for t in model.values())

        recv = BroadcastReceiver(RunDir(run_root), member, timeout_s=60, attempt="t", load=load)
        while not recv.closed():
            with recv.gate:
                before = total()
                time.sleep(hold_s)
                out.put(("held", member, total() == before))
            update = recv.poll()
            if update is not None:
                buffers = sum(b.numel() * b.element_size() for bufs in recv._free[0].values() for b in bufs)
                out.put(("got", member, update.version, total(), update.tensors, buffers, recv.torn))
            recv.wait(0.05)
        out.put(("closed", member))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", member, f"{type(e).__name__}: {e}", traceback.format_exc()))


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_member_loading_in_place_takes_each_update_between_generations_with_two_buckets_of_memory(tmp_path):
    """weights.receive=in_place: an update lands only while the worker does not hold its gate (never under a
    generation), bucket by bucket into the engine's own tensors, with two bucket-sized buffers instead of a second
    copy of the model; a buffered member in the same group is unaffected, and an update broken part way by a member's
    death is made whole by the next."""
    run = RunDir(tmp_path).make()
    out = Reports()
    p1 = CTX.Process(target=_in_place_follower, args=(str(tmp_path), 1, out.new_queue(), 1.0), daemon=True)
    p1.start()
    p2 = start(str(tmp_path), 2, out)
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=20)
    assert sender.in_place == {1}
    model_bytes = sum(t.numel() * t.element_size() for _, t in big_weights(1))
    waits, seen = [], []
    for v in (1, 2, 3):
        t0 = time.monotonic()
        sender.publish(v, big_weights(v))
        waits.append(time.monotonic() - t0)
        seen += reported(out, ("got", 1, v))
        got = [r for r in seen if r[:3] == ("got", 1, v)][0]
        expected = sum(t.double().sum().item() for _, t in big_weights(v))
        assert abs(got[3] - expected) < 1e-6 * abs(expected)  # every bucket landed in the engine's tensors
        assert got[4] is None and got[6] is False  # nothing handed over to copy; not torn
        assert got[5] <= 2 * (1 << 20) + 2 * 64 * 1024 * 2  # two 1 MiB fp32 buffers and two of the bf16 bucket
        assert got[5] < model_bytes / 3, (got[5], model_bytes)
    print(f"publish waits (the in-place member holds its gate 1 s per generation): {[round(w, 2) for w in waits]}")
    if ("got", 2, 3) not in [r[:3] for r in seen]:
        seen += reported(out, ("got", 2, 3))  # the buffered member has the last one too
    # The buffered member dies while version 4 goes out: the in-place member may be left with some of 4's buckets
    # loaded (torn); the next update, in a new epoch, loads it whole again.
    os.kill(p2.pid, signal.SIGKILL)
    p2.join(timeout=10)
    sender.publish(4, big_weights(4))
    sender.publish(5, big_weights(5))
    assert sender.members == [1]
    seen += reported(out, ("got", 1, 5))
    got = [r for r in seen if r[:3] == ("got", 1, 5)][0]
    expected = sum(t.double().sum().item() for _, t in big_weights(5))
    assert abs(got[3] - expected) < 1e-6 * abs(expected) and got[6] is False
    sender.close()
    reports = seen
    deadline = time.time() + 60
    while {r[1] for r in reports if r[0] in ("closed", "error")} != {1}:
        assert time.time() < deadline, reports
        reports += out.drain(0.5)
    assert not [r for r in reports if r[0] == "error"], reports
    assert len([r for r in reports if r[0] == "held"]) >= 3 and all(r[2] for r in reports if r[0] == "held")  # no weight ever changed under a generation
    p1.join(timeout=30)
    assert p1.exitcode == 0


def test_a_restarted_only_worker_is_admitted_while_the_trainer_waits_for_its_rollouts(tmp_path):
    """With one worker, no update comes while it is down (the trainer waits for its rollouts): its next life must be
    admitted between updates (the trainer's `admit` while it waits), not at an update that cannot come."""
    run = RunDir(tmp_path).make()
    out = Reports()
    procs = {1: start(str(tmp_path), 1, out)}
    sender = BroadcastSender(run, num_receivers=1, bucket_mb=1, timeout_s=60, attempt="t", member_timeout_s=20)
    published(sender, 1)
    reported(out, ("got", 1, 1))
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(timeout=10)
    procs[1] = start(str(tmp_path), 1, out)
    deadline = time.time() + 60
    while sender.admitted != {1}:
        assert time.time() < deadline, "the restarted worker was not admitted between updates"
        sender.admit()  # what the trainer does between two looks at the queue
        time.sleep(0.05)
    published(sender, 2)
    assert sender.members == [1]
    seen = reported(out, ("got", 1, 2))
    assert not [r for r in seen if r[0] == "error"], seen
    sender.close()
    reported(out, ("closed", 1))
    procs[1].join(timeout=30)


# What torch prints when a store call fails or runs out of time (C++ warnings, with a C++ stack), and Python's own.
ALARMS = ("[c10d]", "waitForInput", "DistNetworkError", "Connection reset by peer", "Traceback")


def _logged(target, log, *args):
    """`target(*args)` with this process's stderr (torch's C++ warnings included) in `log`, as a role's log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    target(*args)


def _ending_trainer(run_root, silent_s, end):
    """The trainer of a run that ends well: one update, `silent_s` with nothing to say (a step), then, once `end` is
    set, the last step's end: the group closes and the process ends at once, as a role does (os._exit), taking its
    store along."""
    sender = BroadcastSender(RunDir(run_root), num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t")
    sender.publish(1, weights(1))
    time.sleep(silent_s)
    end.wait(timeout=120)
    sender.close()
    os._exit(0)


def _busy_follower(run_root, member, out, busy_s, busy):
    """`_follower` whose loop, after the first update, keeps the interpreter for `busy_s` (a generation in Python),
    from when it sets the event `busy`: its receiver thread does not run meanwhile, so it reads what the trainer says
    then late."""
    try:
        recv = BroadcastReceiver(RunDir(run_root), member, timeout_s=60, attempt="t")
        while not recv.closed():
            update = recv.poll()
            if update is not None:
                out.put(("got", member, update.version))
                if busy_s:
                    switch = sys.getswitchinterval()
                    sys.setswitchinterval(60)  # no other thread of this process runs until this one waits
                    t0 = time.monotonic()
                    busy.set()  # (not a report: the queue's feeder thread would not run either)
                    while time.monotonic() - t0 < busy_s:
                        pass
                    sys.setswitchinterval(switch)
            recv.wait(0.05)
        recv.close()
        out.put(("closed", member))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", member, f"{type(e).__name__}: {e}", traceback.format_exc()))


def ended_run_logs(tmp_path, silent_s, busy_s=0.0):
    """Runs `_ending_trainer` to the end with two `_busy_follower`s, ending it once both are busy; returns each
    process's log."""
    RunDir(tmp_path).make()
    out, end, busy = Reports(), CTX.Event(), {m: CTX.Event() for m in (1, 2)}
    logs = [tmp_path / "trainer.log", tmp_path / "inference-1.log", tmp_path / "inference-2.log"]
    procs = [CTX.Process(target=_logged, args=(_ending_trainer, str(logs[0]), str(tmp_path), silent_s, end),
                         daemon=True)]
    procs += [CTX.Process(target=_logged, args=(_busy_follower, str(logs[m]), str(tmp_path), m, out.new_queue(), busy_s,
                                                busy[m]), daemon=True) for m in (1, 2)]
    for p in procs:
        p.start()
    if busy_s:
        assert all(busy[m].wait(timeout=120) for m in (1, 2)), "the followers got no update"
    end.set()
    reports = []
    deadline = time.time() + 120 + silent_s
    while {r[1] for r in reports if r[0] in ("closed", "error")} != {1, 2}:
        assert time.time() < deadline, reports
        reports += out.drain(0.5)
    for p in procs:
        p.join(timeout=30)
    assert sorted(r for r in reports if r[0] in ("closed", "error")) == [("closed", 1), ("closed", 2)], reports
    assert {r[1:] for r in reports if r[0] == "got"} == {(1, 1), (2, 1)}, reports
    return {log.name: log.read_text() for log in logs}


def alarms(logs) -> str:
    """What of `logs` (name: text) shows one of ALARMS: each such line with the lines around it, under its log's name
    ('' if none), for a failing assertion to print whole."""
    found = []
    for name, text in logs.items():
        lines = text.splitlines()
        hits = [i for i, line in enumerate(lines) if any(a in line for a in ALARMS)]
        if hits:
            shown = sorted({j for i in hits[:5] for j in range(max(0, i - 3), min(len(lines), i + 12))})
            found.append(f"==== {name} ({len(hits)} alarming line(s))\n" + "\n".join(lines[j] for j in shown))
    return "\n".join(found)


@pytest.mark.slow  # 40 s of silence
def test_members_waiting_through_a_long_step_log_nothing(tmp_path):
    """A trainer that says nothing for 40 s (a long step, a checkpoint, the final evaluation) is no timeout."""
    found = alarms(ended_run_logs(tmp_path, silent_s=40))
    assert not found, found


def test_the_end_of_a_run_leaves_nothing_alarming_in_the_logs_of_members_busy_meanwhile(tmp_path):
    """The trainer's process ends right after the close while its members are busy generating (for 3 s): they leave
    the group and its store before the store goes, so no log shows a closed connection."""
    found = alarms(ended_run_logs(tmp_path, silent_s=0, busy_s=3.0))
    assert not found, found
