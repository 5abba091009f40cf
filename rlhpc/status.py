"""`python -m rlhpc.status RUN_DIR` (or `rlhpc-status RUN_DIR`): where a run stands, from its run directory.

Shows the run's Slurm job(s) and their states (run_dir/jobs.json + sacct/squeue; local runs have none), the trainer's
step, the recent rollout and held-out rewards, queue depth and staleness, the last heartbeat of every role, and, for a
failed run, which role failed, why, and the end of its log. Reads files only: safe to run at any time, from any node
that sees the run directory. A file it cannot read (half-written, or damaged) is named under "unreadable" and the rest
is shown. `--json` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlhpc.run.metrics import bottleneck, busy_by_process, current, phase_of
from rlhpc.run.procs import tail
from rlhpc.run.rundir import (RunDir, free_bytes, is_number, out_of_space_advice, read_json_object, runs_module,
                          size_text, space_problem)
from rlhpc.run.evaluation import read_curve

# The files the status could not read -> why (rlhpc.run.rundir.read_json_object); shown by their path in the run
# directory.
Unreadable = Dict[Path, str]


def _in_run(run: RunDir, path: Path) -> str:
    try:
        return str(path.relative_to(run.root))
    except ValueError:
        return str(path)


def _metrics_tail(path: Path, max_bytes: int = 256 << 10, run: Optional[RunDir] = None,
                  bad: Optional[Unreadable] = None) -> List[Dict[str, Any]]:
    """The last rows of a metrics.jsonl (only its end is read: the file grows with the run). Rows as rlhpc.run.metrics
    writes them, numbers only; any other row is skipped and, with `bad`, counted there."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    rows, wrong = [], 0
    for line in data.splitlines()[1 if size > max_bytes else 0:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash or by the seek
            continue
        if isinstance(row, dict) and "resumed" in row:
            rows.append(row)  # a resume's mark (rlhpc.run.metrics.current)
        elif isinstance(row, dict) and "step" in row and all(is_number(v) for v in row.values()):
            rows.append(row)
        else:  # the sums and comparisons below would fail on it
            wrong += 1
    if wrong and bad is not None and run is not None:
        bad[path] = f"{wrong} row(s) skipped: a metrics row holds numbers only"
    return current(rows)


def _last(rows: List[Dict[str, Any]], key: str) -> Optional[Dict[str, Any]]:
    for row in reversed(rows):
        if key in row:
            return row
    return None


def _script_run_dir(run: RunDir) -> Optional[str]:
    """The run_dir that run_dir/job.sbatch names when it is not this folder (the folder was moved or copied since the
    script was written), else None."""
    from rlhpc.cluster.hetjob import script_run_dir

    try:
        named = script_run_dir((run.root / "job.sbatch").read_text(errors="replace"))
    except OSError:
        return None
    if named is None:
        return None
    try:
        return None if os.path.samefile(named, run.root) else named
    except OSError:
        return named  # gone, or never here


def collect(run: RunDir, slurm: bool = True) -> Dict[str, Any]:
    out: Dict[str, Any] = {"run_dir": str(run.root)}
    bad: Unreadable = {}
    now = time.time()
    if run.summary.exists():
        out["state"] = "finished"
    elif run.failed.exists():
        out["state"] = "failed"
    elif run.requeue.exists():
        out["state"] = "checkpointed, waiting to be requeued"
    else:
        out["state"] = "running or not started"

    from rlhpc.run.slurm_jobs import FINAL, recorded_jobs

    jobs = recorded_jobs(run, bad)
    out["jobs"] = []
    for entry in jobs:
        job: Dict[str, Any] = {"job_id": entry["job_id"], "name": entry.get("name", ""),
                               "launcher": entry.get("launcher", "")}
        if slurm:
            from rlhpc.run.slurm_jobs import query

            st = query(entry["job_id"])
            job.update(state=st.state, source=st.source,
                       components=[{"job_id": c.job_id, "role": c.role, "state": c.state, "exit_code": c.exit_code,
                                    "nodes": c.nodes, "elapsed": c.elapsed, "reason": c.reason} for c in st.components])
        out["jobs"].append(job)

    last = out["jobs"][-1] if out["jobs"] else None
    local = _config_value(run, "launcher.name") == "local"
    if out["state"].startswith("checkpointed") and local:  # stopped by Ctrl-C or SIGTERM: no requeue will come
        out["state"] = f"stopped with a checkpoint: launch again with run_dir={run.root} to go on"
    if last and last.get("state") in FINAL and out["state"] not in ("finished", "failed"):
        # The files say nothing ended (a cancelled job, one that failed before any role wrote its marker): Slurm does.
        out["state"] = f"stopped: its Slurm job {last['job_id']} ended {last['state']}"
        batch_log = run.logs / f"slurm-{last['job_id']}.out"
        if batch_log.exists() and last["state"] != "CANCELLED":
            out["batch_log"] = {"log": str(batch_log), "log_tail": tail(batch_log, 20)}

    rows = _metrics_tail(run.logs / "trainer-0.metrics.jsonl", run=run, bad=bad)
    heartbeats = run.heartbeats(bad)
    if out["state"] == "running or not started" and local:
        gone = _launcher_gone(run, heartbeats)
        if gone:
            out["state"] = (f"stopped: its launcher ({gone}) and its roles are gone, and none said why (killed?); "
                            f"launch again with run_dir={run.root} to go on")
    hb = heartbeats.get("trainer-0", {})
    trainer: Dict[str, Any] = {}
    if hb.get("phase") == "sft":
        # The metrics carry every SFT step (the heartbeat at most one a second).
        done = [r["step"] for r in rows if "sft/loss" in r]
        trainer.update(phase="sft", sft_step=max(done) if done else hb.get("sft_step"), sft_steps=hb.get("sft_steps"))
    saved = read_json_object(run.sft_state / "state.json", bad, numbers=("step",))
    if saved and not (run.model / "READY").exists():  # a warm start saved, not done: a relaunch goes on from it
        trainer["sft_saved_step"] = saved["step"]
    rl_rows = [r for r in rows if phase_of(r) == "rl"]
    if rl_rows or "step" in hb:
        hb_step = hb["step"] if is_number(hb.get("step")) else 0
        trainer.update(phase="rl", step=max([r["step"] for r in rl_rows] + [hb_step]), steps=hb.get("steps"))
    for key, name in (("rollout/reward", "reward"), ("eval/heldout_reward", "heldout_reward"),
                      ("async/staleness_mean", "staleness_mean")):
        row = _last(rl_rows, key)  # eval/heldout_reward: runs from before evaluation moved to inference worker 0
        if row:
            trainer[name] = row[key]
            trainer[f"{name}_step"] = row["step"]
    curve = read_curve(run, bad)  # run_dir/evals/: the held-out reward of version v is that after step v
    if curve:
        trainer["heldout_reward_step"], trainer["heldout_reward"] = curve[-1]
    if not trainer.get("steps"):
        cfg = _config_steps(run)
        if cfg is not None:
            trainer["steps"] = cfg
    out["trainer"] = trainer

    pending = run.queue / "pending"
    try:
        out["queue_pending_files"] = sum(1 for p in pending.iterdir()
                                         if p.suffix == ".safetensors" and not p.name.startswith("."))
    except FileNotFoundError:
        out["queue_pending_files"] = None

    out["heartbeats"] = {
        name: {"age_s": round(now - info["time"], 1),
               **{k: v for k, v in info.items() if k in ("host", "step", "version", "phase")}}
        for name, info in heartbeats.items()
    }
    # Where the time goes lately (the tail of each process's metrics): working, or waiting for the other side.
    out["busy"] = busy_by_process(run, rows_of=lambda path: _metrics_tail(path, 64 << 10, run=run, bad=bad))
    # Workers serving the policy over HTTP (inference.serve=true): rendezvous/serve-<rank>.json.
    out["endpoints"] = [e for e in (read_json_object(p, bad) for p in sorted(run.rendezvous.glob("serve-*.json"))) if e]
    fail = run.failure_report(bad)
    if fail:
        out["failure"] = fail
    summary = read_json_object(run.summary, bad)
    if summary:
        out["summary"] = {k: summary.get(k) for k in ("heldout_reward_base", "heldout_reward_sft", "heldout_reward_rl",
                                                     "rl_steps", "wall_time_s") if k in summary}
    elsewhere = _script_run_dir(run)
    if elsewhere is not None and out["state"] != "finished":
        # Submitted as is, its job would write (and fail to write its log) in the folder it names.
        out["job_script"] = (f"job.sbatch names run_dir={elsewhere}, not this folder (moved?): do not submit it; "
                             f"launch again with run_dir={run.root} (launcher.submit=false writes it anew, only)")
    out["unreadable"] = {_in_run(run, p): why for p, why in sorted(bad.items())}
    out["disk_free_bytes"] = free_bytes(run.root)
    if out["state"] != "finished":  # a full disk may have kept the failing role from writing status/FAILED
        full = space_problem(run.root)
        if full:
            out["disk_problem"] = f"out of space: {full}; {out_of_space_advice(run.root)}"
    return out


def _launcher_gone(run: RunDir, heartbeats: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """For a local run: its launcher ("pid N on <host>", from the launch lock) when neither it nor any role of the run
    is alive on this machine; None when one is, or when this machine cannot tell (a launch from another host)."""
    from rlhpc.preflight.rundir import launcher_of

    launcher = launcher_of(run.root)
    if launcher is None or launcher[1] != os.uname().nodename:
        return None
    if runs_module(launcher[0], "rlhpc.launch") or run.live_roles(heartbeats):
        return None
    return f"pid {launcher[0]} on {launcher[1]}"


def _config_steps(run: RunDir) -> Optional[int]:
    steps = _config_value(run, "trainer.steps")
    return steps if isinstance(steps, int) else None  # an unreadable config only costs the "of N"


def _config_value(run: RunDir, key: str) -> Any:
    """The value of `key` in the run's config.yaml, or None where it cannot be read."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(OmegaConf.load(run.config), key)
    except Exception:  # noqa: BLE001 - a config damaged by a foreign hand: the status shows the rest
        return None


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def render(info: Dict[str, Any]) -> str:
    lines = [f"run_dir: {info['run_dir']}", f"state:   {info['state']}"]
    if not info["jobs"]:
        lines.append("slurm:   no Slurm job recorded (a local run, or not submitted yet)")
    for job in info["jobs"]:
        head = f"slurm:   job {job['job_id']} {job['name']}".rstrip()
        if "state" in job:
            head += f": {job['state']}"
            if job["source"] not in ("sacct", "squeue"):
                head += f" ({job['source']})"
        lines.append(head)
        for c in job.get("components", []):
            extra = "".join(f" {k} {c[k]}" for k in ("nodes", "elapsed", "exit_code") if c.get(k))
            if c.get("reason") and c["reason"] != "None":
                extra += f" reason {c['reason']}"
            lines.append(f"         {c['job_id']:<10} {c['role']:<10} {c['state']:<10}{extra}")
    t = info["trainer"]
    if t.get("phase") == "sft" and "step" not in t:
        line = f"trainer: SFT step {t.get('sft_step')}/{t.get('sft_steps')}"
        if "sft_saved_step" in t:
            line += f" (saved at step {t['sft_saved_step']}: a relaunch goes on from it)"
        lines.append(line)
    elif "step" in t:
        line = f"trainer: step {t['step']}/{t.get('steps', '?')}"
        if "reward" in t:
            line += f"  reward {_fmt(t['reward'])} (step {t['reward_step']})"
        if "heldout_reward" in t:
            line += f"  held-out {_fmt(t['heldout_reward'])} (step {t['heldout_reward_step']})"
        lines.append(line)
    else:
        lines.append("trainer: no step yet")
    queue = "?" if info["queue_pending_files"] is None else info["queue_pending_files"]
    stale = t.get("staleness_mean")
    # A finished run's pending files were generated while the last steps trained: nothing is waiting for them.
    left = " (generated past the last step: never trained)" if info["state"] == "finished" and queue else ""
    lines.append(f"queue:   {queue} pending file(s){left}; staleness {'-' if stale is None else _fmt(stale)} steps")
    if info["heartbeats"]:
        lines.append("heartbeats (last seen):")
        for name, hb in info["heartbeats"].items():
            extra = "".join(f" {k} {hb[k]}" for k in ("phase", "step", "version") if k in hb)
            lines.append(f"  {name:<14} {hb['age_s']:>7.1f}s ago  on {hb.get('host', '?')}{extra}")
    else:
        lines.append("heartbeats: none yet")
    if info.get("busy"):
        lines.append("time (recent rows): " + "; ".join(f"{name} busy {b['busy']:.0%}, waiting {b['waiting']:.0%}"
                                                        for name, b in info["busy"].items()))
        verdict = bottleneck(info["busy"])
        if verdict:
            lines.append(f"         {verdict}")
    for e in info.get("endpoints", []):
        auth = "open" if e.get("auth") == "open" else f"token in rendezvous/{e.get('token_file')}"
        lines.append(f"serving: worker {e.get('rank')} at {e.get('url')}, model {e.get('model')} ({auth})")
    if "summary" in info:
        lines.append("summary: " + ", ".join(f"{k} {_fmt(v)}" for k, v in info["summary"].items()))
    if "failure" in info:
        f = info["failure"]
        lines += [f"failed:  {f.get('role')} rank {f.get('rank')}: {f.get('error')}",
                  f"--- last lines of {f['log']} ---", f["log_tail"]]
    if "batch_log" in info and "failure" not in info:
        lines += [f"--- last lines of {info['batch_log']['log']} ---", info["batch_log"]["log_tail"]]
    if info.get("job_script"):
        lines.append(f"script:  {info['job_script']}")
    for path, why in info.get("unreadable", {}).items():
        lines.append(f"unreadable: {path} ({why})")
    if info.get("disk_problem"):
        lines.append(f"disk:    {info['disk_problem']}")
    elif info.get("disk_free_bytes") is not None:
        lines.append(f"disk:    {size_text(info['disk_free_bytes'])} free under run_dir")
    return "\n".join(lines)


# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "the status was shown",
    2: "RUN_DIR is not a run directory, or the arguments are wrong",
}


def parser() -> argparse.ArgumentParser:
    from rlhpc.config.commandline import argparser

    ap = argparser("rlhpc-status", __doc__, EXIT_CODES)
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (run_dir=... of the launch)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--no-slurm", action="store_true", help="do not ask sacct/squeue")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    run = RunDir(Path(args.run_dir))
    if not run.config.exists():
        print(f"rlhpc-status: {run.root} is not a run directory (no config.yaml written by rlhpc.launch)",
              file=sys.stderr)
        return 2
    info = collect(run, slurm=not args.no_slurm)
    print(json.dumps(info, indent=1) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
