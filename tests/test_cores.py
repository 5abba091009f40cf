"""Cores lent between the roles of one machine (launcher.lend_cores): a waiting role's threads go to the other role's
processes while it waits, shared evenly, never above the machine's cores, and come back when it works again."""

import torch

from rlhpc.run import cores
from rlhpc.run.rundir import RunDir


def test_a_waiting_worker_lends_its_threads_to_the_trainer_until_it_works_again(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "EVERY_S", 0.0)
    run = RunDir(tmp_path).make()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        borrower = cores.Borrower(run, "inference", own=1, borrowers=1, cap=4)
        workers = [cores.Idle(run, "inference", r, threads=1) for r in range(2)]
        borrower.adjust()
        assert torch.get_num_threads() == 1  # nobody waits yet
        workers[0].set(True)
        borrower.adjust()
        assert torch.get_num_threads() == 2
        workers[1].set(True)
        borrower.adjust()
        assert torch.get_num_threads() == 3
        workers[0].set(False)
        workers[1].set(False)
        borrower.adjust()
        assert torch.get_num_threads() == 1
        assert not list(cores.idle_dir(run).iterdir())  # nothing left behind
    finally:
        torch.set_num_threads(before)


def test_idle_threads_are_shared_between_borrowers_and_capped_at_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "EVERY_S", 0.0)
    run = RunDir(tmp_path).make()
    cores.Idle(run, "trainer", 0, threads=4).set(True)
    cores.Idle(run, "trainer", 1, threads=4).set(True)
    two_workers = cores.Borrower(run, "trainer", own=1, borrowers=2, cap=64)
    assert two_workers.lent() == 4  # 8 idle threads over 2 workers
    assert cores.Borrower(run, "inference", own=1, borrowers=1).lent() == 0  # only the other role's marks count
    before = torch.get_num_threads()
    try:
        capped = cores.Borrower(run, "trainer", own=1, borrowers=1, cap=3)
        capped.adjust()
        assert torch.get_num_threads() == 3
        capped.release()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_borrower_looks_before_each_block_of_a_forward_and_of_its_backward(tmp_path, monkeypatch):
    from rlhpc.config.schema import ModelConfig
    from rlhpc.modeling import models

    monkeypatch.setattr(cores, "EVERY_S", 0.0)
    run = RunDir(tmp_path).make()
    models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2), tmp_path / "model")
    model = models.load_model(tmp_path / "model")
    borrower = cores.Borrower(run, "inference", own=1, borrowers=1, cap=2)
    looks = []
    real = borrower.adjust
    def spy(*_args):  # a forward pre-hook returns None, or it would replace the block's inputs
        looks.append(torch.is_grad_enabled())
        real()

    monkeypatch.setattr(borrower, "adjust", spy)
    borrower.attach(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    loss = model(input_ids=ids).logits.sum()
    assert len(looks) == 2  # one per block in the forward
    loss.backward()
    assert len(looks) == 4  # and one per block as its backward starts


def test_a_disabled_mark_writes_nothing(tmp_path):
    run = RunDir(tmp_path).make()
    cores.Idle(run, "trainer", 0, threads=1, enabled=False).set(True)
    assert not cores.idle_dir(run).exists()


def test_the_warm_start_takes_the_threads_of_the_processes_waiting_for_it_on_one_machine():
    from rlhpc.config.schema import Config

    cfg = Config()
    cfg.trainer.threads, cfg.trainer.num_ranks, cfg.inference.threads, cfg.inference.num_workers = 1, 1, 1, 2
    assert cores.warm_start_threads(cfg) == min(3, cores.cores())
    cfg.trainer.threads = 64  # its own threads, even above the cores: what the user asked for
    assert cores.warm_start_threads(cfg) == 64
    cfg.trainer.threads = 1
    cfg.launcher.lend_cores = False
    assert cores.warm_start_threads(cfg) == 1
    cfg.launcher.lend_cores, cfg.launcher.name = True, "slurm"  # the others wait on other nodes
    assert cores.warm_start_threads(cfg) == 1
