"""The queue contract of DESIGN.md: atomic publish, durable claims, staleness, quarantine, bounded cost."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from rlhpc.transport.queue import Group, Queue, RolloutBatch


def make_batch(num_groups=2, group_size=3, version=0, prompt_len=4, completion_len=5, tag="g"):
    tokens, logprobs, mask, adv, group_of, lengths, groups = [], [], [], [], [], [], []
    for g in range(num_groups):
        for s in range(group_size):
            n = prompt_len + completion_len + s
            tokens.append(torch.arange(n) + 100 * g)
            logprobs.append(torch.cat([torch.zeros(prompt_len), -torch.rand(n - prompt_len)]))
            mask.append(torch.cat([torch.zeros(prompt_len, dtype=torch.bool), torch.ones(n - prompt_len, dtype=torch.bool)]))
            adv.append(float(s) - 1.0)
            group_of.append(g)
            lengths.append(n)
        groups.append(Group(uid=f"{tag}-{version}-{g}-{time.monotonic_ns()}", env="test", task_id=str(g), version=version,
                            num_samples=group_size, rewards=[0.0] * group_size, truncated=[False] * group_size,
                            min_version=version))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return RolloutBatch(torch.cat(tokens), offsets, torch.cat(logprobs), torch.cat(mask), torch.tensor(adv),
                        torch.tensor(group_of), groups)


def test_a_published_file_round_trips_every_tensor_and_the_metadata(tmp_path):
    q = Queue(tmp_path)
    b = make_batch()
    q.publish(b, "w0", 0)
    claim = q.claim(0, num_groups=2, min_version=0, timeout_s=1)
    got = claim.batch
    for name in ("tokens", "offsets", "logprobs", "loss_mask", "advantages", "group_of"):
        assert torch.equal(getattr(got, name), getattr(b, name)), name
    assert [g.uid for g in got.groups] == [g.uid for g in b.groups]


def test_readers_never_see_a_partial_file_while_a_producer_writes(tmp_path):
    q = Queue(tmp_path)
    big = make_batch(num_groups=40, group_size=8, completion_len=400)
    stop = threading.Event()
    seen_bad = []

    def reader():
        while not stop.is_set():
            for p in q.pending_files():
                try:
                    RolloutBatch.from_bytes(p.read_bytes())
                except FileNotFoundError:
                    pass
                except ValueError as e:
                    seen_bad.append((p.name, e))

    t = threading.Thread(target=reader)
    t.start()
    for seq in range(15):
        q.publish(big, "w0", seq)
    stop.set()
    t.join()
    assert seen_bad == []
    assert not [p for p in q.pending.iterdir() if p.name.startswith(".tmp")]


def test_producers_never_collide_on_names(tmp_path):
    q = Queue(tmp_path)
    paths = {q.publish(make_batch(), p, s) for p in ("w0", "w1") for s in range(3)}
    assert len(paths) == 6 and len(q.pending_files()) == 6


def test_a_claim_is_durable_the_same_step_gets_the_same_groups_after_a_restart(tmp_path):
    q = Queue(tmp_path)
    for s in range(4):
        q.publish(make_batch(version=0, tag=f"f{s}"), "w0", s)
    first = q.claim(0, num_groups=4, min_version=0, timeout_s=1)
    # A "restarted" trainer (new Queue object) resuming at step 0 trains on exactly the same groups.
    again = Queue(tmp_path).claim(0, num_groups=4, min_version=0, timeout_s=1)
    assert [g.uid for g in again.batch.groups] == [g.uid for g in first.batch.groups]
    # The next step gets the remaining files: none lost, none twice.
    nxt = Queue(tmp_path).claim(1, num_groups=4, min_version=0, timeout_s=1)
    assert not {g.uid for g in nxt.batch.groups} & {g.uid for g in first.batch.groups}
    assert len(nxt.batch.groups) == 4


def test_a_claim_interrupted_before_its_manifest_keeps_the_files_it_had_moved(tmp_path):
    q = Queue(tmp_path)
    for s in range(2):
        q.publish(make_batch(version=0, tag=f"f{s}"), "w0", s)
    # Simulate a crash after moving one file into step 0 but before writing the manifest.
    first = q.pending_files()[0]
    q.step_dir(0).mkdir(parents=True)
    os.replace(first, q.step_dir(0) / first.name)
    claim = q.claim(0, num_groups=4, min_version=0, timeout_s=1)
    assert len(claim.files) == 2 and first.name in claim.files
    assert len(claim.batch.groups) == 4


def test_workers_see_how_many_groups_the_claim_being_filled_holds(tmp_path):
    """A claim tells its progress after each pass that moved files: workers count those groups as covered."""
    q = Queue(tmp_path)
    q.publish(make_batch(num_groups=1, tag="a"), "w0", 0)  # a file may hold fewer groups than a worker's batch
    result = {}
    claimer = threading.Thread(target=lambda: result.update(claim=q.claim(
        0, num_groups=3, min_version=0, timeout_s=30, on_progress=lambda n: q.set_progress(0, 0, claiming=n))))
    claimer.start()
    deadline = time.time() + 10
    while Queue(tmp_path).progress().get("claiming") != 1 and time.time() < deadline:
        time.sleep(0.01)
    assert Queue(tmp_path).progress() == {"claimed": 0, "version": 0, "claiming": 1}
    q.publish(make_batch(num_groups=2, tag="b"), "w0", 1)
    claimer.join(timeout=30)
    assert len(result["claim"].batch.groups) == 3
    assert Queue(tmp_path).progress()["claiming"] == 3  # then the trainer moves `claimed` on (rlhpc/train/claims.py)


def test_groups_older_than_the_staleness_bound_are_dropped_and_counted(tmp_path):
    q = Queue(tmp_path)
    q.publish(make_batch(version=1, tag="old"), "w0", 0)
    q.publish(make_batch(version=3, tag="new"), "w0", 1)
    claim = q.claim(4, num_groups=2, min_version=3, timeout_s=1)  # step 4, async_level 1
    assert claim.dropped_groups == 2
    assert all(g.version == 3 for g in claim.batch.groups)
    assert len(list(q.dropped.iterdir())) == 1


def test_a_corrupt_or_truncated_file_is_quarantined_with_a_reason_and_the_claim_goes_on(tmp_path):
    q = Queue(tmp_path)
    good = q.publish(make_batch(tag="good"), "w0", 0)
    data = good.read_bytes()
    for name, content in (("w1-00000000.safetensors", data[: len(data) // 2]), ("w2-00000000.safetensors", b"garbage")):
        (q.pending / name).write_bytes(content)  # truncated, garbage; older than the good file
        os.utime(q.pending / name, ns=(1, 1))
    claim = q.claim(0, num_groups=2, min_version=0, timeout_s=1)
    assert claim.quarantined_files == 2
    reasons = sorted(p.name for p in q.quarantine.glob("*.reason"))
    assert reasons == ["w1-00000000.safetensors.reason", "w2-00000000.safetensors.reason"]
    assert len(claim.batch.groups) == 2


def test_a_claim_that_cannot_be_filled_times_out_naming_the_config_key(tmp_path):
    q = Queue(tmp_path)
    with pytest.raises(TimeoutError, match="trainer.rollout_timeout_s"):
        q.claim(0, num_groups=1, min_version=0, timeout_s=0.2)


def test_a_claim_stops_waiting_when_told_a_role_failed(tmp_path):
    q = Queue(tmp_path)
    with pytest.raises(RuntimeError, match="worker died"):
        q.claim(0, num_groups=1, min_version=0, timeout_s=30, abort=lambda: "worker died")


def test_retired_steps_leave_the_steps_folder_so_listing_cost_stays_bounded(tmp_path):
    q = Queue(tmp_path)
    for step in range(20):
        q.publish(make_batch(num_groups=1, tag=f"s{step}"), "w0", step)
        q.claim(step, num_groups=1, min_version=0, timeout_s=1)
        q.retire_before(step + 1, keep=step % 2 == 0)
    assert list(q.steps.iterdir()) == []
    assert len(q.pending_files()) == 0
    assert len(list(q.retired.iterdir())) == 10


def test_the_ledger_records_each_trained_group_once_and_is_cut_back_on_resume(tmp_path):
    q = Queue(tmp_path)
    for step in range(3):
        q.publish(make_batch(num_groups=1, tag=f"s{step}"), "w0", step)
        q.record(step, q.claim(step, num_groups=1, min_version=0, timeout_s=1))
    assert [e["step"] for e in q.ledger()] == [0, 1, 2]
    q.truncate_ledger(before_step=1)
    assert [e["step"] for e in q.ledger()] == [0]


def test_a_published_file_is_plain_safetensors_that_the_library_loads_alone(tmp_path):
    b = make_batch()
    path = Queue(tmp_path).publish(b, "w0", 0)
    tensors = load(path.read_bytes())
    assert tensors["tokens"].dtype == torch.int32 and torch.equal(tensors["tokens"].long(), b.tokens)
    assert torch.equal(tensors["loss_mask"].bool(), b.loss_mask) and torch.equal(tensors["offsets"], b.offsets)
    assert torch.equal(tensors["logprobs"], b.logprobs) and torch.equal(tensors["advantages"], b.advantages)


def test_a_file_written_by_the_safetensors_library_itself_loads(tmp_path):
    """Files of the layout the queue wrote before it wrote safetensors itself, still pending at an upgrade."""
    b = make_batch()
    data = save({"tokens": b.tokens.int(), "offsets": b.offsets, "logprobs": b.logprobs,
                 "loss_mask": b.loss_mask.to(torch.uint8), "advantages": b.advantages, "group_of": b.group_of.int()},
                metadata={"rlhpc": json.dumps({"producer": "w0", "groups": [g.__dict__ for g in b.groups]})})
    got = RolloutBatch.from_bytes(data)
    assert torch.equal(got.tokens, b.tokens) and [g.uid for g in got.groups] == [g.uid for g in b.groups]


def test_a_claim_whose_manifest_a_power_loss_emptied_gets_the_same_files_again(tmp_path):
    q = Queue(tmp_path)
    for s in range(4):
        q.publish(make_batch(tag=f"f{s}"), "w0", s)
    first = q.claim(0, num_groups=4, min_version=0, timeout_s=1)
    q.record(0, first)
    (q.step_dir(0) / "manifest.json").write_bytes(b"")  # its bytes are not fsynced, only its name
    again = Queue(tmp_path).claim(0, num_groups=4, min_version=0, timeout_s=1)
    assert sorted(again.files) == sorted(first.files) and len(q.pending_files()) == 2


def test_claims_become_durable_at_the_sync_before_a_checkpoint_not_per_step(tmp_path, monkeypatch):
    q = Queue(tmp_path)
    for s in range(12):
        q.publish(make_batch(tag=f"f{s}"), "w0", s)
    fsynced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    for step in range(3):
        claim = q.claim(step, num_groups=8, min_version=0, timeout_s=1)
        assert len(claim.files) == 4
        q.record(step, claim)
    assert fsynced == [] and len(q.ledger()) == 3  # recorded, in the page cache: a dead process loses nothing
    q.sync()
    assert sorted(fsynced) == sorted([str(q.step_dir(s)) for s in range(3)] + [str(q.pending),
                                                                                str(q.root / "ledger.jsonl")])
    fsynced.clear()
    q.sync()  # nothing recorded since: only what a sync always covers
    assert sorted(fsynced) == sorted([str(q.pending), str(q.root / "ledger.jsonl")])


def test_the_trainer_syncs_the_queue_before_each_checkpoint_is_written(monkeypatch):
    from rlhpc.train import trainer as trainer_module

    calls = []
    t = trainer_module.Trainer.__new__(trainer_module.Trainer)
    t.is_main, t.rank, t.beat = True, 0, {"step": 10, "steps": 20}
    beat = lambda self, role, rank, **fields: calls.append(f"beat saving={fields['saving']}")  # noqa: E731
    t.run = type("Run", (), {"checkpoints": Path("unused"), "heartbeat": beat})()
    t.model = t.optimizer = t.scheduler = None
    t.claims = type("Claims", (), {"sync": lambda self: calls.append("sync"),
                                    "retire_before": lambda self, step: calls.append(f"retire {step}")})()
    monkeypatch.setattr(trainer_module.checkpoint, "save", lambda *a, **k: calls.append("checkpoint"))
    t.save_checkpoint(10)
    assert calls == ["beat saving=10", "sync", "checkpoint", "retire 10"]


def test_a_ledger_line_torn_by_a_power_loss_is_ignored_only_at_the_end(tmp_path):
    q = Queue(tmp_path)
    q.publish(make_batch(tag="a"), "w0", 0)
    q.record(0, q.claim(0, num_groups=2, min_version=0, timeout_s=1))
    with open(q.root / "ledger.jsonl", "a") as f:
        f.write('{"step": 1, "grou')  # the tail of a step after the last checkpoint
    assert [e["step"] for e in q.ledger()] == [0]
    q.truncate_ledger(before_step=1)  # what a resume does
    assert (q.root / "ledger.jsonl").read_text().count("\n") == 1
    with open(q.root / "ledger.jsonl", "a") as f:
        f.write('garbage\n{"step": 1, "groups": []}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        q.ledger()


def test_counts_are_written_once_per_claim_however_many_files_it_sets_aside(tmp_path, monkeypatch):
    import rlhpc.transport.queue as queue_module

    q = Queue(tmp_path)
    for i in range(10):
        (q.pending / f"bad-{i:08d}.safetensors").write_bytes(b"junk")
        q.publish(make_batch(version=0, tag=f"stale{i}"), "w0", i)
    q.publish(make_batch(version=5, tag="fresh"), "w0", 99)
    writes = []
    real = queue_module.write_json
    monkeypatch.setattr(queue_module, "write_json",
                        lambda path, *a, **k: (writes.append(path.name), real(path, *a, **k)))
    q.claim(5, num_groups=2, min_version=5, timeout_s=5, max_version=5)
    assert writes.count("counts.json") == 1
    assert Queue(tmp_path).counts() == {"pending_files": 0, "dropped_files": 10, "quarantined_files": 10}


def test_metadata_is_json_in_the_safetensors_header(tmp_path):
    q = Queue(tmp_path)
    path = q.publish(make_batch(version=7), "w3", 9)
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    meta = json.loads(header["__metadata__"]["rlhpc"])
    assert meta["producer"] == "w3" and {g["version"] for g in meta["groups"]} == {7}


def test_a_claim_of_several_files_holds_exactly_their_samples_in_order(tmp_path):
    q = Queue(tmp_path)
    published = [make_batch(num_groups=g, group_size=2 + g, completion_len=3 + g, tag=f"f{g}") for g in (1, 2, 3)]
    for seq, b in enumerate(published):
        q.publish(b, "w0", seq)
    got = q.claim(0, num_groups=6, min_version=0, timeout_s=5).batch
    want = RolloutBatch.concat(published)
    for name in ("tokens", "offsets", "logprobs", "loss_mask", "advantages", "group_of"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert [g.uid for g in got.groups] == [g.uid for g in want.groups]


def test_workers_read_the_last_whole_progress_while_the_trainer_rewrites_it(tmp_path):
    q = Queue(tmp_path)
    stop, seen = threading.Event(), []

    def reader():
        while not stop.is_set():
            seen.append(Queue(tmp_path).progress())

    t = threading.Thread(target=reader)
    t.start()
    for i in range(1, 2000):
        q.set_progress(claimed=i, version=i, claiming=i)
    stop.set()
    t.join(timeout=30)
    before_any = {"claimed": 0, "version": 0}
    assert seen and all(p == before_any or p["claimed"] == p["version"] == p["claiming"] for p in seen)
    claimed = [p["claimed"] for p in seen]
    assert claimed == sorted(claimed)  # never an older record after a newer one
    assert Queue(tmp_path).progress() == {"claimed": 1999, "version": 1999, "claiming": 1999}


def test_a_progress_record_garbled_by_a_crash_gives_way_to_the_one_before(tmp_path):
    q = Queue(tmp_path)
    q.set_progress(claimed=4, version=4)
    q.set_progress(claimed=5, version=4, claiming=3)
    path = tmp_path / "progress.json"
    lines = path.read_bytes().splitlines(keepends=True)
    newest = next(i for i, line in enumerate(lines) if b'"claimed": 5' in line)
    lines[newest] = lines[newest].replace(b'"claiming": 3', b'"claiming": 9')  # half of a write, or a bit flip
    path.write_bytes(b"".join(lines))
    assert Queue(tmp_path).progress() == {"claimed": 4, "version": 4, "claiming": 0}
    q.set_progress(claimed=6, version=5)  # the next write replaces the garbled record
    assert Queue(tmp_path).progress() == {"claimed": 6, "version": 5, "claiming": 0}
    path.write_bytes(b"\0" * 256)  # both slots lost
    assert Queue(tmp_path).progress() == {"claimed": 0, "version": 0}


def test_progress_is_rewritten_in_place_not_replaced(tmp_path, monkeypatch):
    """A rename over an existing file makes ext4 flush the new file's data first: milliseconds on a busy disk."""
    q = Queue(tmp_path)
    q.set_progress(claimed=1, version=1)
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (renames.append(a), real(*a))[1])
    for i in range(10):
        q.set_progress(claimed=2 + i, version=2 + i)
    assert renames == [] and Queue(tmp_path).progress()["claimed"] == 11
