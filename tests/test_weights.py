"""The weights contract: a token-guarded group of separate processes, HF names, and logprob parity after an update."""

import multiprocessing as mp
import traceback

import pytest
import torch

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.rundir import RunDir
from rlhpc.train.batching import pad, token_logprobs
from rlhpc.transport.weights import (BroadcastReceiver, BroadcastSender, FilesystemReceiver, FilesystemSender, latest_snapshot)

CTX = mp.get_context("spawn")
SEQS = [[1, 5, 9, 44, 70, 2, 3], [1, 100, 101, 102, 2, 120, 121, 122, 2], [7, 8]]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return models.build(ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2), tmp_path_factory.mktemp("m"))


def _receiver(run_root, rank, model_dir, token, out):
    """An inference-side process: joins the group, applies one update to an HF engine, reports what it computes."""
    try:
        from rlhpc.infer.engines.hf import HFEngine

        engine = HFEngine.from_pretrained(str(model_dir))
        recv = BroadcastReceiver(RunDir(run_root), rank, timeout_s=60, attempt="t", token=token)
        update = None
        while update is None:
            update = recv.poll()
        engine.update_weights(update.tensors)
        out.put(("ok", rank, update.version, {n: t.double().sum().item() for n, t in update.tensors},
                 engine.score(SEQS, temperature=0.7)))
        while not recv.closed():
            recv.poll()
    except BaseException as e:  # noqa: BLE001
        out.put(("error", rank, type(e).__name__, str(e), traceback.format_exc()))


def _start(run_root, rank, model_dir, out, token=None):
    p = CTX.Process(target=_receiver, args=(run_root, rank, model_dir, token, out), daemon=True)
    p.start()
    return p


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_every_worker_receives_the_update_and_computes_the_trainers_logprobs(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path).make()
    out = CTX.Queue()
    procs = [_start(str(tmp_path), r, tiny_model_dir, out) for r in (1, 2)]
    trainer_model = perturbed(models.load_model(tiny_model_dir))
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t")
    sender.publish(5, trainer_model.named_parameters())
    results = [out.get(timeout=120) for _ in procs]
    sender.close()
    for p in procs:
        p.join(timeout=30)

    ids, attn = pad([torch.tensor(s) for s in SEQS], 0)
    ref, _ = token_logprobs(trainer_model, ids, attn, temperature=0.7)
    expected_sums = {n: t.detach().double().sum().item() for n, t in trainer_model.named_parameters()}
    for status, rank, version, sums, scores in results:
        assert status == "ok", (rank, version, sums)
        assert version == 5
        assert sums.keys() == expected_sums.keys()  # Hugging Face names, every parameter
        assert all(abs(sums[n] - expected_sums[n]) < 1e-6 * max(1.0, abs(expected_sums[n])) for n in sums)
        for i, s in enumerate(scores):
            got = torch.tensor(s)
            want = ref[i, : len(SEQS[i]) - 1].detach()
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
            # The mismatch KL between the two sides is ~0 in fp32.
            assert float((torch.exp(want - got) - 1 - (want - got)).mean()) < 1e-8


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_member_without_the_token_is_refused_and_the_group_still_forms(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path).make()
    out = CTX.Queue()
    intruder = _start(str(tmp_path), 1, tiny_model_dir, out, token="0" * 32)
    model = models.load_model(tiny_model_dir)
    import threading

    holder = {}
    t = threading.Thread(target=lambda: holder.setdefault(
        "sender", BroadcastSender(run, num_receivers=1, bucket_mb=1, timeout_s=60, attempt="t")))
    t.start()
    status = out.get(timeout=120)
    assert status[0] == "error" and status[2] == "PermissionError" and "wrong token" in status[3]
    intruder.join(timeout=30)
    legit = _start(str(tmp_path), 1, tiny_model_dir, out)
    t.join(timeout=120)
    sender = holder["sender"]
    sender.publish(1, model.named_parameters())
    assert out.get(timeout=120)[0] == "ok"
    sender.close()
    legit.join(timeout=30)


def test_a_sender_waiting_for_members_times_out_naming_the_key(tmp_path):
    run = RunDir(tmp_path).make()
    with pytest.raises(TimeoutError, match="weights.timeout_s"):
        BroadcastSender(run, num_receivers=1, bucket_mb=1, timeout_s=1, attempt="t")


def test_the_filesystem_transport_delivers_the_newest_snapshot(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path).make()
    model = models.load_model(tiny_model_dir)
    sender, receiver = FilesystemSender(run), FilesystemReceiver(run, version=0)
    assert receiver.poll() is None
    sender.publish(1, model.named_parameters())
    perturbed(model)
    sender.publish(2, model.named_parameters())
    update = receiver.poll()
    assert update.version == 2 and latest_snapshot(run) == 2
    got = dict(update.tensors)
    assert all(torch.equal(got[n], p.detach()) for n, p in model.named_parameters())
    assert receiver.poll() is None
    sender.close()
    assert receiver.closed()


def mixed_weights(version):
    """Tensors of every kind a bucket plan meets, with 1 MiB buckets: runs of small fp32 tensors (packed, more buckets
    than staging buffers), tensors of half a bucket and more (each a bucket of its own, sent from its own memory), one
    of them not contiguous, and bf16 tensors after the fp32 ones."""
    g = torch.Generator().manual_seed(1000 + version)
    small = [(f"model.layers.{i}.input_layernorm.weight", torch.randn(96 * 1024, generator=g)) for i in range(24)]
    big = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(512, 768, generator=g)) for i in range(3)]
    transposed = [("model.layers.0.mlp.down_proj.weight", torch.randn(768, 512, generator=g).t())]
    half = [(f"model.layers.{i}.self_attn.q_norm.weight", torch.randn(200 * 1024, generator=g).to(torch.bfloat16))
            for i in range(8)]
    half_bucket = [("model.norm.weight", torch.randn(160 * 1024, generator=g))]  # 640 KiB: alone, though it fits
    return small[:6] + half_bucket + small[6:12] + big + small[12:] + transposed + half


def fingerprints(tensors):
    """name -> (shape, dtype, sha256 of the bytes): equal only for bit-identical tensors."""
    import hashlib

    return {n: (tuple(t.shape), str(t.dtype), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest())
            for n, t in tensors}


def _fingerprinting_receiver(run_root, rank, versions, out):
    """Reports each update's fingerprints and where its tensors live (to see its buffers reused)."""
    try:
        recv = BroadcastReceiver(RunDir(run_root), rank, timeout_s=60, attempt="t")
        got = 0
        while got < versions:
            update = recv.poll()
            if update is None:
                recv.wait(0.05)
                continue
            got += 1
            out.put(("ok", rank, update.version, fingerprints(update.tensors),
                     sorted({t.untyped_storage().data_ptr() for _, t in update.tensors})))
        while not recv.closed():
            recv.wait(0.05)
            recv.poll()
    except BaseException as e:  # noqa: BLE001
        out.put(("error", rank, type(e).__name__, str(e), traceback.format_exc()))


def test_overlapped_buckets_of_several_versions_arrive_bit_identical_into_reused_buffers(tmp_path):
    run = RunDir(tmp_path).make()
    out = CTX.Queue()
    procs = [CTX.Process(target=_fingerprinting_receiver, args=(str(tmp_path), r, 4, out), daemon=True)
             for r in (1, 2)]
    for p in procs:
        p.start()
    sender = BroadcastSender(run, num_receivers=2, bucket_mb=1, timeout_s=60, attempt="t")
    staging = None
    for v in (1, 2, 3, 4):
        sent = sender.publish(v, mixed_weights(v))
        assert sent == sum(t.numel() * t.element_size() for _, t in mixed_weights(v))
        reports = [out.get(timeout=120) for _ in procs]
        for r in reports:
            assert r[0] == "ok", r
            assert r[2] == v
            assert r[3] == fingerprints(mixed_weights(v))  # every tensor, under its name, bit for bit
        if v == 1:
            storages = {r[1]: set() for r in reports}
        for r in reports:
            storages[r[1]].add(tuple(r[4]))
        if v > 1:  # the sender packs into the same staging buffers for every update
            assert {k: b.data_ptr() for k, b in sender._buffers.items()} == staging
        staging = {k: b.data_ptr() for k, b in sender._buffers.items()}
    assert all(len(sets) <= 2 for sets in storages.values()), storages  # receive buffers: at most two sets, reused
    assert len(staging) <= 4  # two staging buffers per dtype
    sender.close()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0


def test_a_receiver_waiting_for_its_next_update_closes_at_once(tmp_path):
    import threading
    import time

    run = RunDir(tmp_path).make()
    holder = {}
    t = threading.Thread(target=lambda: holder.setdefault(
        "sender", BroadcastSender(run, num_receivers=1, bucket_mb=1, timeout_s=60, attempt="t")), daemon=True)
    t.start()
    recv = BroadcastReceiver(run, 1, timeout_s=60, attempt="t")
    t.join(timeout=60)
    time.sleep(0.5)  # the receiver is waiting for the trainer's next message
    t0 = time.monotonic()
    recv.close()
    # Not the group's 60 s timeout nor the bell's hour: the close wakes the receiver's thread, which leaves at once.
    assert time.monotonic() - t0 < 5 and recv.closed()
    holder["sender"].close()
