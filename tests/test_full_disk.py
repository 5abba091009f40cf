"""A full disk (or an exceeded quota) under run_dir, on a real small filesystem (a tmpfs of a few MiB): a launch that
could not reach its first checkpoint is refused before anything is written; mid-run, the roles stop at once, the
launcher names the filesystem and what to do, nothing half-written is left to hold space, the last checkpoint stays
whole, and the same command resumes from it once there is room."""

import errno
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from rlhpc.run.rundir import atomic_write, space_problem
from rlhpc.train import checkpoint
from rlhpc.transport.queue import Queue
from test_queue import make_batch


@pytest.fixture
def small_fs(tmp_path):
    """mount(size_mb) -> a folder on a fresh tmpfs of that size; unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    mounted = []

    def mount(size_mb: float) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb * 1024)}k", "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """Writes a file into `folder` until its filesystem is full."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            os.write(fd, b"\0" * (64 << 10))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def leftovers(folder: Path):
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith(".tmp-"))


def test_a_full_filesystem_is_named_and_a_failed_write_leaves_the_old_file_and_no_temporary(small_fs, tmp_path):
    assert space_problem(tmp_path) is None
    fs = small_fs(1)
    atomic_write(fs / "state.json", b'{"step": 1}')
    queue = Queue(fs / "queue")
    filler = fill(fs)
    assert space_problem(fs) == f"No space left on device under {fs} (0 B free)"
    with pytest.raises(OSError) as e:
        atomic_write(fs / "state.json", b'{"step": 2}' + b" " * (64 << 10))
    assert e.value.errno == errno.ENOSPC
    assert (fs / "state.json").read_bytes() == b'{"step": 1}'
    with pytest.raises(OSError):
        queue.publish(make_batch(num_groups=4, group_size=4, completion_len=2000), "w0", 0)
    assert leftovers(fs) == [] and queue.pending_files() == []
    filler.unlink()
    assert space_problem(fs) is None
    queue.publish(make_batch(num_groups=4, group_size=4, completion_len=2000), "w0", 0)  # room again: it works
    assert len(queue.pending_files()) == 1


def test_a_checkpoint_that_does_not_fit_is_removed_and_the_previous_one_stays_whole(small_fs):
    fs = small_fs(3)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)  # 131k parameters: a checkpoint of ~1.6 MB with its AdamW moments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def step():
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    step()
    checkpoint.save(fs, 1, model, optimizer, scheduler, {})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    # DCP's writer reports the full disk as a torch.save "unexpected pos" error; the checkpoint says what it is.
    with pytest.raises(OSError, match=rf"the checkpoint of step 2 does not fit: No space left on device under {fs} "):
        checkpoint.save(fs, 2, model, optimizer, scheduler, {})
    assert sorted(p.name for p in fs.iterdir()) == ["latest.json", "step_00000001"]  # no partial step_00000002
    assert json.loads((fs / "latest.json").read_text())["step"] == 1
    fresh = torch.nn.Linear(256, 512)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = checkpoint.load(checkpoint.latest(fs), fresh, fresh_opt,
                            torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0))
    assert state["step"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k


def launch(*overrides, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", *overrides], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_launch_that_cannot_reach_its_first_checkpoint_is_refused_before_writing_anything(small_fs):
    fs = small_fs(12)  # the quick start writes ~19 MiB before its first checkpoint
    proc = launch("+exp=reverse_text", f"run_dir={fs / 'run'}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(f"error: this plan cannot run. The filesystem of run_dir={fs / 'run'} has "
                                          "12.0 MiB free, and the run writes 18.8 MiB before it can resume from a "
                                          "checkpoint"), proc.stderr
    assert "Change run_dir" in proc.stderr and "Traceback" not in proc.stderr
    assert list(fs.iterdir()) == []
    dry = launch("+exp=reverse_text", f"run_dir={fs / 'run'}", "dry_run=true", timeout=120)
    assert dry.returncode == 0 and "note: a launch with this run_dir is refused" in dry.stdout


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_it_at_once_naming_it_and_the_same_command_resumes(small_fs,
                                                                                        quickstart_sft_model):
    from faults import rl_overrides

    fs = small_fs(64)
    run = fs / "run"
    args = [*rl_overrides(quickstart_sft_model, 12, 2), f"run_dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        latest = run / "checkpoints" / "latest.json"
        deadline = time.time() + 300
        while not latest.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        if not latest.exists():
            proc.kill()
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"no checkpoint was written (launch exit {proc.returncode}): {err[-3000:]}")
        filler = fill(fs)
        filled = time.time()
        out, err = proc.communicate(timeout=120)
        stopped_s = time.time() - filled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert stopped_s < 60, f"the run took {stopped_s:.0f}s to stop on a full disk"
    assert f"run_dir is out of space: No space left on device under {run} (0 B free); free space (or raise your " \
           f"quota) under {run}, or move that folder where there is room, then launch the same command with " \
           "run_dir=<the folder>: the run resumes from its last checkpoint (step " in err, err[-3000:]
    assert leftovers(run) == [], "a failed write left a temporary file holding space"
    kept = json.loads(latest.read_text())
    assert (run / "checkpoints" / kept["path"] / "trainer.json").exists()  # whole: written before latest.json

    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run), "--no-slurm"], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and f"disk:    out of space: No space left on device under {run}" in status.stdout

    filler.unlink()
    again = launch(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    log = (run / "logs" / "trainer-0.log").read_text()
    assert f"resumed from {run / 'checkpoints' / 'step_'}" in log
    ledger = [json.loads(line) for line in (run / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in ledger) == list(range(12))  # every step once: none lost, none twice
    groups = Counter(u for e in ledger for u in e["groups"])
    assert max(groups.values()) == 1
