"""A queue no file can break, and whose waiting costs stay bounded: every invalid file is quarantined with its reason
(also when reloaded at resume), dead producers' announcements expire, dropped/ and quarantine/ stay small."""

import json
import os
import random
import time

import pytest
import torch
from safetensors.torch import load, save

from rlhpc.run.rundir import Backoff
from rlhpc.transport.queue import SUFFIX, Queue, RolloutBatch
from test_queue import make_batch


def valid_bytes(**kw) -> bytes:
    return make_batch(**kw).to_bytes("w0")


def with_meta(edit) -> bytes:
    """A valid file whose JSON metadata `edit` changed in place."""
    b = make_batch()
    meta = {"producer": "w0", "groups": [dict(g.__dict__) for g in b.groups]}
    edit(meta)
    return save(load(b.to_bytes("w0")), metadata={"rlhpc": json.dumps(meta)})


def with_tensors(edit) -> bytes:
    """A valid file whose tensors `edit` changed (dtype, shape, values), metadata kept."""
    data = valid_bytes()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = load(data)
    edit(tensors)
    return save(tensors, metadata=meta)


def with_header(edit) -> bytes:
    """A valid file whose safetensors header `edit` changed (the JSON padded back to a multiple of 8 bytes)."""
    data = valid_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def shift(header, name, by):
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]


INVALID = {
    "unreadable bytes": (b"\x00\x01garbage" * 10, "not a readable rollout file"),
    "truncated": (valid_bytes()[:300], "not a readable rollout file"),
    "metadata missing": (save({"tokens": torch.zeros(1, dtype=torch.int32)}), "not a readable rollout file"),
    "metadata not an object": (with_meta(lambda m: m.clear()), "metadata has no list of groups"),
    "zero groups": (with_meta(lambda m: m.update(groups=[])), "zero groups"),
    "group field missing": (with_meta(lambda m: m["groups"][0].pop("version")), "missing fields ['version']"),
    "unknown group field": (with_meta(lambda m: m["groups"][0].update(colour="red")), "unknown fields ['colour']"),
    "version of the wrong type": (with_meta(lambda m: m["groups"][0].update(version="3")), "version '3'"),
    "num_samples mismatch": (with_meta(lambda m: m["groups"][0].update(num_samples=2, rewards=[0.0, 0.0],
                                                                        truncated=[False, False])),
                             "num_samples"),
    "non-finite reward": (with_meta(lambda m: m["groups"][1]["rewards"].__setitem__(0, float("nan"))),
                          "rewards are not num_samples finite numbers"),
    "duplicate uid": (with_meta(lambda m: m["groups"][1].update(uid=m["groups"][0]["uid"])), "is not a new"),
    "tensor missing": (with_tensors(lambda t: t.pop("advantages")), "missing tensor 'advantages'"),
    "wrong dtype": (with_tensors(lambda t: t.update(tokens=t["tokens"].float())), "tensor 'tokens' is torch.float32"),
    "wrong shape": (with_tensors(lambda t: t.update(logprobs=t["logprobs"].reshape(1, -1))), "not a 1-d"),
    "sizes do not add up": (with_tensors(lambda t: t.update(logprobs=t["logprobs"][:-1])), "inconsistent tensor sizes"),
    "non-finite advantage": (with_tensors(lambda t: t["advantages"].__setitem__(2, float("inf"))),
                             "non-finite advantages"),
    "non-finite logprob": (with_tensors(lambda t: t["logprobs"].__setitem__(7, float("nan"))), "non-finite logprobs"),
    "negative token id": (with_tensors(lambda t: t["tokens"].__setitem__(0, -5)), "negative token ids"),
    "token id beyond the vocabulary": (with_tensors(lambda t: t["tokens"].__setitem__(0, 10**6)),
                                       "beyond the model's vocabulary (1000)"),
    "version from the future": (valid_bytes(version=9), "version 9 is from the future"),
    "byte ranges that overlap": (with_header(lambda h: shift(h, "tokens", -4)), "not a readable rollout file"),
    "a byte range beyond the file": (with_header(lambda h: shift(h, "loss_mask", 8)), "not a readable rollout file"),
    "a shape that does not match its bytes": (with_header(lambda h: h["tokens"].update(shape=[3])),
                                              "not a readable rollout file"),
    "an unknown dtype": (with_header(lambda h: h["tokens"].update(dtype="Q7")), "not a readable rollout file"),
}


@pytest.mark.parametrize("kind", sorted(INVALID))
def test_every_kind_of_invalid_file_is_quarantined_with_its_reason_and_the_claim_goes_on(tmp_path, kind):
    data, reason = INVALID[kind]
    q = Queue(tmp_path, vocab_size=1000)
    (q.pending / f"bad-00000000{SUFFIX}").write_bytes(data)
    os.utime(q.pending / f"bad-00000000{SUFFIX}", ns=(1, 1))  # older than the good file: read first
    q.publish(make_batch(tag="good"), "w0", 0)
    claim = q.claim(3, num_groups=2, min_version=0, timeout_s=5, max_version=3)
    assert [g.uid.split("-")[0] for g in claim.batch.groups] == ["good", "good"]
    assert claim.quarantined_files == 1 and q.counts()["quarantined_files"] == 1
    assert reason in (q.quarantine / f"bad-00000000{SUFFIX}.reason").read_text()


def mutations(valid: bytes, rng: random.Random):
    """Random corruptions of a valid file: bit flips, cut or inserted bytes, and edits of the header's JSON."""
    n = int.from_bytes(valid[:8], "little")
    header = valid[8 : 8 + n]
    for _ in range(400):
        kind = rng.randrange(6)
        data = bytearray(valid)
        if kind == 0:  # flip bits anywhere
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            data = data[: rng.randrange(len(data))]
        elif kind == 2:  # insert or delete bytes
            i = rng.randrange(len(data))
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) if rng.random() < 0.5 else b""
            if rng.random() < 0.5:
                del data[i : i + rng.randint(1, 16)]
        elif kind == 3:  # flip bytes inside the header only (JSON that may still parse)
            h = bytearray(header)
            for _ in range(rng.randint(1, 4)):
                h[rng.randrange(len(h))] = rng.choice(b'0123456789-.,:[]{}"eE ntruefalsn')
            data = bytearray(valid[:8]) + h + valid[8 + n :]
        elif kind == 4:  # a wrong header length
            data[:8] = rng.randrange(0, 2**64).to_bytes(8, "little")
        else:  # replace a metadata value by a value of another type
            meta = json.loads(json.loads(header)["__metadata__"]["rlhpc"])
            g = rng.choice(meta["groups"])
            key = rng.choice(sorted(g))
            g[key] = rng.choice([None, -1, 10**12, 1.5, "x", [], {}, [None], True, float("nan")])
            new_header = json.loads(header)
            new_header["__metadata__"]["rlhpc"] = json.dumps(meta)
            h = json.dumps(new_header).encode()
            h += b" " * (-len(h) % 8)
            data = bytearray(len(h).to_bytes(8, "little")) + h + valid[8 + n :]
        yield bytes(data)


def test_randomly_corrupted_files_never_make_the_reader_raise(tmp_path):
    rng = random.Random(0)
    q = Queue(tmp_path, vocab_size=1000, keep_quarantined=10**6)
    valid = valid_bytes(num_groups=3)
    outcomes = {"valid": 0, "quarantined": 0}
    for i, data in enumerate(mutations(valid, rng)):
        path = q.pending / f"m-{i:08d}{SUFFIX}"
        path.write_bytes(data)
        checked, quarantined = q._read_or_quarantine(path, max_version=5)
        assert (checked is None) == quarantined, i
        outcomes["valid" if checked is not None else "quarantined"] += 1
        if checked is not None:  # what passes is consistent enough to train on, alone or with other files
            for b in (RolloutBatch._of([checked]), RolloutBatch._of([checked, checked])):
                assert b.offsets[-1] == b.tokens.numel() and len(b.groups) >= 1
                assert bool(torch.isfinite(b.advantages).all()) and int(b.tokens.max()) < 1000
                assert torch.bincount(b.group_of).tolist() == [g.num_samples for g in b.groups]
            path.unlink()
        else:
            assert not path.exists() and (q.quarantine / (path.name + ".reason")).exists()
    assert outcomes["quarantined"] > 300, outcomes
    assert q.counts()["quarantined_files"] == outcomes["quarantined"]


def test_a_claim_over_hundreds_of_corrupt_files_finishes(tmp_path):
    rng = random.Random(1)
    q = Queue(tmp_path, vocab_size=1000, keep_quarantined=50)
    for i, data in enumerate(mutations(valid_bytes(), rng)):
        (q.pending / f"m-{i:08d}{SUFFIX}").write_bytes(data)
    q.publish(make_batch(tag="good"), "w0", 0)
    trained = []
    for step in range(1000):  # claim until the queue runs dry: only a timeout (nothing left) ends it
        try:
            trained += q.claim(step, num_groups=2, min_version=0, timeout_s=0.2, max_version=0).batch.groups
        except TimeoutError:
            break
    assert q.pending_files() == [] and any(g.uid.startswith("good") for g in trained)
    assert q.counts()["quarantined_files"] > 300
    assert len(list(q.quarantine.glob(f"*{SUFFIX}"))) <= 50 + 50 // 4  # rotated, not growing with the run


def test_files_reloaded_at_resume_are_validated_again(tmp_path):
    q = Queue(tmp_path)
    for s in range(2):
        q.publish(make_batch(tag=f"f{s}"), "w0", s)
    first = q.claim(0, num_groups=4, min_version=0, timeout_s=1)
    broken = q.step_dir(0) / first.files[1]
    broken.write_bytes(broken.read_bytes()[:100])  # damaged on disk while the trainer was down
    again = Queue(tmp_path).claim(0, num_groups=4, min_version=0, timeout_s=1, max_version=0)
    assert again.files == first.files[:1] and again.quarantined_files == 1
    assert (q.quarantine / (first.files[1] + ".reason")).exists()
    assert broken.exists()  # linked, not moved: other trainer ranks read the same bytes and reach the same verdict
    other_rank = Queue(tmp_path).wait_claim(0, timeout_s=1, max_version=0)
    assert [g.uid for g in other_rank.batch.groups] == [g.uid for g in again.batch.groups]


def test_a_resumed_claim_with_no_valid_file_left_claims_afresh_and_other_ranks_follow(tmp_path):
    q = Queue(tmp_path)
    q.publish(make_batch(tag="old"), "w0", 0)
    first = q.claim(0, num_groups=2, min_version=0, timeout_s=1)
    (q.step_dir(0) / first.files[0]).write_bytes(b"rotten")
    q.publish(make_batch(tag="new"), "w0", 1)
    again = Queue(tmp_path).claim(0, num_groups=2, min_version=0, timeout_s=1)
    assert {g.uid.split("-")[0] for g in again.batch.groups} == {"new"}
    assert json.loads((q.step_dir(0) / "manifest.json").read_text())["revision"] == 1
    other_rank = Queue(tmp_path).wait_claim(0, timeout_s=1)
    assert [g.uid for g in other_rank.batch.groups] == [g.uid for g in again.batch.groups]


def test_dropped_and_quarantined_files_are_rotated_and_their_totals_kept(tmp_path):
    q = Queue(tmp_path, keep_dropped=4, keep_quarantined=4)
    for i in range(20):
        q.publish(make_batch(version=0, tag=f"stale{i}"), "w0", i)
        (q.pending / f"bad-{i:08d}{SUFFIX}").write_bytes(b"junk")
    q.publish(make_batch(version=5, tag="fresh"), "w0", 99)
    q.claim(5, num_groups=2, min_version=5, timeout_s=5, max_version=5)
    assert len(list(q.dropped.glob(f"*{SUFFIX}"))) == 4
    assert len(list(q.quarantine.glob(f"*{SUFFIX}"))) == 4 and len(list(q.quarantine.glob("*.reason"))) == 4
    assert Queue(tmp_path).counts() == {"pending_files": 0, "dropped_files": 20, "quarantined_files": 20}


def test_a_temporary_file_of_a_producer_that_died_while_writing_is_removed(tmp_path):
    q = Queue(tmp_path, lease_s=0.1)
    tmp = q.pending / f".tmp-w0-00000001{SUFFIX}-4242"
    tmp.write_bytes(b"half a file")
    assert q.pending_files() == [] and tmp.exists()  # young: maybe still being written
    os.utime(tmp, (time.time() - 5, time.time() - 5))
    q.pending_files()
    assert not tmp.exists() and q.totals()["abandoned_temp_files"] == 1


def test_a_dead_producers_inflight_marker_stops_counting_after_the_lease(tmp_path):
    q = Queue(tmp_path, lease_s=0.3)
    q.begin_batch("w1")
    q._lease._stop.set()  # the producer dies: nobody renews its lease (kill -9 leaves the marker behind)
    q._lease._thread.join()
    assert q.inflight_batches() == 1 and q.inflight_batches(exclude="w1") == 0
    time.sleep(0.4)
    assert q.inflight_batches() == 0
    time.sleep(0.4)
    q.inflight_batches()
    assert list(q.inflight.iterdir()) == []  # long expired: removed by a reader


def test_a_live_producers_lease_is_renewed_while_it_generates(tmp_path):
    producer, reader = Queue(tmp_path, lease_s=0.3), Queue(tmp_path, lease_s=0.3)
    producer.begin_batch("w1")
    for _ in range(6):  # 1.2 s: four leases long
        time.sleep(0.2)
        assert reader.inflight_batches() == 1
    producer.end_batch("w1")
    assert reader.inflight_batches() == 0 and list(producer.inflight.iterdir()) == []


def test_waits_back_off_to_the_limit_and_start_again_after_progress():
    b = Backoff(max_s=0.5)
    waits = [b.next() for _ in range(10)]
    assert waits[:4] == [0.01, 0.02, 0.04, 0.08] and waits[-1] == 0.5 and max(waits) == 0.5
    b.reset()
    assert b.next() == 0.01


@pytest.mark.slow
def test_a_run_finishes_while_corrupt_files_keep_landing_in_its_queue(tmp_path):
    import subprocess
    import sys
    import threading

    run_dir = tmp_path / "run"
    pending, ledger = run_dir / "queue" / "pending", run_dir / "queue" / "ledger.jsonl"
    corrupt = list(mutations(valid_bytes(), random.Random(2)))[:40]

    def saboteur():
        deadline = time.time() + 120
        while not ledger.exists() and time.time() < deadline:  # RL has started
            time.sleep(0.05)
        for i, data in enumerate(corrupt):  # a few every step
            (pending / f"x{i}-00000000{SUFFIX}").write_bytes(data)
            time.sleep(0.05)

    t = threading.Thread(target=saboteur)
    t.start()
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0",
         "launcher.progress=false", "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
         "trainer.steps=16", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=300)
    t.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == 16
    counts = json.loads((run_dir / "queue" / "counts.json").read_text())
    assert counts["quarantined_files"] >= 10  # others were valid after their mutation, or landed after the last step
    reasons = list((run_dir / "queue" / "quarantine").glob("*.reason"))
    assert reasons and all(r.read_text().strip() for r in reasons)
