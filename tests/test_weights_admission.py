"""The weights group admits only the run: a client with a wrong token, a client that connects and stalls, and a client
speaking garbage are refused or ignored while the group forms, and none of them holds it up."""

import datetime
import json
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.rundir import RunDir
from rlhpc.transport.weights import BroadcastReceiver, BroadcastSender
from test_weights import CTX, _start


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tmp_path_factory.mktemp("m"))


def start_sender(run, num_receivers, timeout_s):
    holder = {}

    def make():
        try:
            holder["sender"] = BroadcastSender(run, num_receivers=num_receivers, bucket_mb=1, timeout_s=timeout_s,
                                               attempt="t")
        except BaseException as e:  # noqa: BLE001
            holder["error"] = e

    t = threading.Thread(target=make, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not (run.rendezvous / "weights.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    return t, holder, json.loads((run.rendezvous / "weights.json").read_text())


def store_client(info):
    return dist.TCPStore(info["host"], info["port"], info["world_size"], False, timeout=datetime.timedelta(seconds=10))


def test_intruders_are_refused_or_ignored_and_the_group_forms_without_waiting_for_them(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path).make()
    sender_thread, holder, info = start_sender(run, num_receivers=1, timeout_s=60)
    t0 = time.monotonic()
    # 1. Connects to the rendezvous port and never says a word (held open for the whole test).
    staller = socket.create_connection((info["host"], info["port"]))
    # 2. Speaks garbage to the same port.
    for payload in (os.urandom(256), b"\xff" * 4096, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((info["host"], info["port"])) as s:
            s.sendall(payload)
    # 3. Speaks the store's protocol but claims rank 1 with bytes that are no token, then goes silent.
    garbage = store_client(info)
    garbage.compare_set("join/1", "", b"\x80\x81:\xfe\xff")
    # 4. A worker with a wrong token (a stale rendezvous file, another run) is refused with a clear error.
    with pytest.raises(PermissionError, match="wrong token"):
        BroadcastReceiver(run, 1, timeout_s=30, attempt="t", token="0" * 32)
    # The real member joins and the group forms at once, intruders and all.
    out = CTX.Queue()
    legit = _start(str(tmp_path), 1, tiny_model_dir, out)
    sender_thread.join(timeout=90)
    assert "error" not in holder, holder.get("error")
    formed_s = time.monotonic() - t0
    sender = holder["sender"]
    sender.publish(1, models.load_model(tiny_model_dir).named_parameters())
    assert out.get(timeout=120)[:3] == ("ok", 1, 1)
    sender.close()
    legit.join(timeout=30)
    staller.close()
    assert formed_s < 45  # the time to start one worker process, not weights.timeout_s


def test_a_second_candidate_for_a_taken_rank_is_refused(tmp_path):
    run = RunDir(tmp_path).make()
    sender_thread, holder, info = start_sender(run, num_receivers=2, timeout_s=3)

    def join(client, nonce, token):
        claim = f"{nonce}:{token}"
        while client.compare_set("join/1", "", claim).decode() != claim:
            time.sleep(0.01)
        client.wait([f"verdict/1/{nonce}"])
        return client.get(f"verdict/1/{nonce}").decode()

    token = info["token"]
    assert join(store_client(info), "first", token) == "ok"
    assert join(store_client(info), "second", token) == "taken"
    sender_thread.join(timeout=30)  # rank 2 never comes: the sender gives up naming it
    assert isinstance(holder.get("error"), TimeoutError) and "inference ranks [2]" in str(holder["error"])
