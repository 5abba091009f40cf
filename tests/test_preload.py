"""Roles forked from the launcher's preload process (launcher.preload, rlhpc/run/preload.py): each stays the launcher's
child with its own exit status, a preload process that dies is reported, and with preload off every role starts as a
new interpreter."""

import json
import subprocess
import sys
import textwrap

from test_launch import launch

FORKED = "(forked from the launcher's preload process)"


def test_with_preload_off_every_role_starts_as_a_new_interpreter(tmp_path):
    """(With it on, the default, the quick start's test checks that every role was forked.)"""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "trainer.steps=2", "algo.group_size=2", "trainer.groups_per_step=2",
                  "inference.groups_per_batch=1", "launcher.preload=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 2
    for name in ("trainer-0", "inference-0", "inference-1"):
        text = (run_dir / "logs" / f"{name}.log").read_text()
        assert f"starting {name.split('-')[0]} rank" in text and FORKED not in text, text[-2000:]
    assert not (run_dir / "logs" / "preload.txt").exists()


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from rlhpc.run.preload import Preload, PreloadError

    tmp = Path(sys.argv[1])
    # A role whose run folder holds no config: rlhpc.role fails at its start and exits 1.
    env = dict(os.environ, RLHPC_ROLE="inference", RLHPC_RANK="0", RLHPC_ROLE_SIZE="1", RLHPC_RUN_DIR=str(tmp / "none"))
    pre = Preload(dict(os.environ), tmp / "preload.txt")
    failing = pre.spawn(env, tmp / "failing.log")
    code = failing.wait(timeout=120)  # waitpid: only a parent can, so the launcher adopted it
    pre.close()
    dead = Preload(dict(os.environ), tmp / "preload-dead.txt")
    dead.proc.kill()
    try:
        dead.spawn(env, tmp / "never.log")
        error = None
    except PreloadError as e:
        error = str(e)
    dead.close()
    print(json.dumps({"code": code, "error": error}))
""")


def test_a_forked_role_is_the_launchers_child_with_its_exit_status_and_a_dead_preload_process_is_reported(tmp_path):
    # In a process of its own: the preload's parent becomes a child subreaper, which pytest's process must not.
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["code"] == 1
    log = (tmp_path / "failing.log").read_text()
    assert f"is `{tmp_path / 'none'}` a run directory written by rlhpc.launch?" in log
    assert out["error"].startswith("the preload process exited with code -9 before it could import"), out
