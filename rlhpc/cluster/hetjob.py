"""One run as one heterogeneous Slurm job: the plan (who gets which resources), its checks, and its batch script.

Component 0 runs the trainer ranks, component 1 the inference workers (the order rlhpc.run.slurm_identity relies
on). One `srun --het-group=0,1` starts every role through the same entry point as the local launcher,
`python -m rlhpc.role`; each task finds its role and rank in Slurm's environment and logs to run_dir/logs/.
An instance over several nodes (`inference.nodes_per_instance` = N > 1) is N tasks of component 1, one a node: the
component has inference.num_workers x N tasks, and task t is worker t // N's vLLM node rank t % N (0: the leader, the
rlhpc worker; 1..N-1: followers that run only vLLM's model workers).

The batch shell owns two duties the roles cannot: it forwards SIGUSR1/SIGTERM to the roles (Slurm signals only the
batch shell with `--signal=B:USR1@grace`), and when the trainer checkpointed and wrote status/REQUEUE it requeues the
job (`cluster.requeue`).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from rlhpc.cluster import container
from rlhpc.config.schema import Config, ConfigError, ContainerConfig, SlurmGroupConfig
from rlhpc.run.slurm_identity import ROLES


@dataclass
class GroupPlan:
    role: str
    component: int
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    mem_gb: int
    time_min: int
    extra: Dict[str, str] = field(default_factory=dict)

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass
class JobPlan:
    name: str
    run_dir: Path
    groups: List[GroupPlan]
    partition: str
    account: str
    qos: str
    grace_s: int
    requeue: bool
    python: str
    setup: List[str]
    max_restarts: int = 0  # inference.max_restarts: a dead worker's task is restarted inside the job
    restart_window_s: int = 3600  # inference.restart_window_s, in whole seconds (the task loop counts in bash)
    restart_backoff_s: float = 1.0  # inference.restart_backoff_s
    nodes_per_instance: int = 1  # inference.nodes_per_instance: the tasks (one a node) of each inference worker
    srun_args: List[str] = field(default_factory=list)  # cluster.srun_args: more options of the srun line
    container: ContainerConfig = field(default_factory=ContainerConfig)  # cluster.container

    @property
    def trainer(self) -> GroupPlan:
        return self.groups[0]

    @property
    def inference(self) -> GroupPlan:
        return self.groups[1]


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key `{key}`: {msg}")


def _group(cfg: Config, component: int) -> GroupPlan:
    role = ROLES[component]
    g: SlurmGroupConfig = getattr(cfg.cluster, role)
    key = f"cluster.{role}"
    n = cfg.inference.nodes_per_instance if role == "inference" else 1
    if role == "trainer":
        tasks, tasks_key = cfg.trainer.num_ranks, "trainer.num_ranks"
    else:  # config validation keeps nodes_per_instance >= 1
        tasks, tasks_key = cfg.inference.num_workers * n, "inference.num_workers"
    # How the count reads in a message: "inference.num_workers=3", or "inference.num_workers=4 x
    # inference.nodes_per_instance=2 = 8" for instances over several nodes.
    count = (f"{tasks_key}={tasks}" if n == 1
             else f"{tasks_key}={cfg.inference.num_workers} x inference.nodes_per_instance={n} = {tasks}")
    _need(g.nodes >= 1, f"{key}.nodes", "must be >= 1")
    _need(g.cpus_per_task >= 1, f"{key}.cpus_per_task", "must be >= 1")
    _need(g.gpus_per_node >= 0, f"{key}.gpus_per_node", "must be >= 0")
    _need(g.mem_gb >= 0, f"{key}.mem_gb", "must be >= 0 (0: the partition's default)")
    _need(g.time_min >= 0, f"{key}.time_min", "must be >= 0 (0: cluster.time_min)")
    if n > 1:  # an instance takes whole nodes: one task (its leader or a follower) on each
        _need(g.tasks_per_node in (0, 1), f"{key}.tasks_per_node",
              f"{g.tasks_per_node}, but an instance over inference.nodes_per_instance={n} nodes runs one task on "
              "each of its nodes: set it to 1 (or 0 to derive it)")
        _need(g.nodes == tasks, f"{key}.nodes",
              f"{g.nodes}, but {count} tasks (per worker a leader and {n - 1} follower(s)) run one to a node: set "
              f"it to {tasks}")
    if g.tasks_per_node:
        _need(
            g.nodes * g.tasks_per_node == tasks, f"{key}.tasks_per_node",
            f"{g.nodes} node(s) x {g.tasks_per_node} task(s) = {g.nodes * g.tasks_per_node} {role} processes, but "
            f"{count}: make {key}.nodes x {key}.tasks_per_node equal {tasks_key} (or set "
            f"{key}.tasks_per_node=0 to derive it)",
        )
        per_node = g.tasks_per_node
    else:
        _need(
            tasks % g.nodes == 0, f"{key}.nodes",
            f"{count} {role} processes do not spread evenly over {g.nodes} nodes",
        )
        per_node = tasks // g.nodes
    return GroupPlan(role, component, g.nodes, per_node, g.cpus_per_task, g.gpus_per_node, g.mem_gb,
                     g.time_min or cfg.cluster.time_min, dict(g.extra))


def make_plan(cfg: Config) -> JobPlan:
    """The job a config asks for; raises ConfigError naming the key when the cluster settings cannot run it."""
    c = cfg.cluster
    groups = [_group(cfg, k) for k in range(len(ROLES))]
    trainer, inference = groups
    _need(c.time_min >= 1, "cluster.time_min", "must be >= 1 minute")
    _need(0 < c.grace_s <= 65535, "cluster.grace_s", "must be between 1 and 65535 seconds")
    for g in groups:
        time_key = f"cluster.{g.role}.time_min" if getattr(c, g.role).time_min else "cluster.time_min"
        _need(
            c.grace_s < g.time_min * 60, "cluster.grace_s",
            f"{c.grace_s}s before the time limit leaves no time to train within {time_key}={g.time_min} min",
        )
    if trainer.gpus_per_node:
        _need(
            trainer.tasks_per_node <= trainer.gpus_per_node, "cluster.trainer.gpus_per_node",
            f"{trainer.tasks_per_node} trainer ranks per node need one GPU each, but a node has "
            f"{trainer.gpus_per_node}",
        )
    if inference.gpus_per_node:
        tp, n = cfg.inference.tensor_parallel_size, cfg.inference.nodes_per_instance
        _need(tp >= 1, "inference.tensor_parallel_size", "must be >= 1")
        per_task = tp // n  # the GPUs of one node of an instance (config validation keeps n | tp)
        what = f"{tp}" if n == 1 else f"{tp} over inference.nodes_per_instance={n} nodes, {per_task} GPUs a node,"
        _need(
            inference.gpus_per_node % per_task == 0, "inference.tensor_parallel_size",
            f"{what} does not divide the {inference.gpus_per_node} GPUs per node (cluster.inference.gpus_per_node)",
        )
        _need(
            inference.tasks_per_node * per_task <= inference.gpus_per_node, "cluster.inference.gpus_per_node",
            f"{inference.tasks_per_node} workers per node x inference.tensor_parallel_size={tp} need "
            f"{inference.tasks_per_node * per_task} GPUs, but a node has {inference.gpus_per_node}",
        )
        if cfg.inference.engine == "vllm" and inference.tasks_per_node > 1:
            _need(
                cfg.inference.engines_per_node == inference.tasks_per_node, "inference.engines_per_node",
                f"{cfg.inference.engines_per_node}, but {inference.tasks_per_node} workers share each node: set it to "
                f"{inference.tasks_per_node} so that each takes its own GPUs",
            )
    return JobPlan(
        name=c.job_name or f"rlhpc-{cfg.exp_name}",
        run_dir=Path(cfg.run_dir).absolute(),
        groups=groups,
        partition=c.partition, account=c.account, qos=c.qos,
        grace_s=c.grace_s,
        requeue=c.requeue,
        # In a container the tasks run the image's Python, not the launcher's.
        python=c.python or ("python3" if c.container.runtime else sys.executable),
        setup=list(c.setup),
        max_restarts=cfg.inference.max_restarts,
        restart_window_s=math.ceil(cfg.inference.restart_window_s),
        restart_backoff_s=cfg.inference.restart_backoff_s,
        nodes_per_instance=cfg.inference.nodes_per_instance,
        srun_args=list(c.srun_args),
        container=c.container,
    )


def python_problem(plan: JobPlan) -> Optional[str]:
    """Why the job's tasks could not start `cluster.python`, as far as this machine can tell (the launch assumes the
    nodes share its filesystem, as they share run_dir); None when it runs, or cannot be judged here. Told at launch,
    not after the job waited in the queue for its nodes: a path that does not exist, a file that is not executable,
    a Python without rlhpc. With `cluster.setup` lines only the path is checked (they may set what it imports), and
    a bare name that only they put on PATH is not judged, nor a Python inside cluster.container's image."""
    python = plan.python
    if python == sys.executable or plan.container.runtime:
        return None  # the launcher's own (cluster.python=""), or the image's (describe says so)
    key = f"config key `cluster.python`: {python}"
    if os.sep not in python:
        if plan.setup:
            return None
        found = shutil.which(python)
        if found is None:
            return (f"{key} is not on this machine's PATH, which the job inherits: give its full path, or put it on "
                    "PATH in cluster.setup (module load, an environment's activation)")
        python = found
    if not os.path.exists(python):
        return (f"{key} does not exist on this machine (the nodes share its filesystem, as they share run_dir): give "
                "the path of an environment that has rlhpc, or leave it empty for the launcher's own Python")
    if not os.access(python, os.X_OK) or os.path.isdir(python):
        return f"{key} is not an executable file: give the path of a Python interpreter"
    if plan.setup:
        return None
    try:  # as the tasks run it: from this folder (the job's working directory), with this environment
        proc = subprocess.run([python, "-c", "import rlhpc.role"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{key} could not be run here ({e}): give the path of a Python interpreter that has rlhpc"
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"{key} cannot import rlhpc ({said}): install rlhpc into that environment (pip install -e <rlhpc "
                "checkout>), or leave cluster.python empty for the launcher's own Python")
    return None


# ---- the batch script ------------------------------------------------------------------------------------------------


def _sbatch(key: str, value: object = "") -> str:
    return f"#SBATCH --{key}" + (f"={shlex.quote(str(value))}" if value != "" else "")


def _component_lines(plan: JobPlan, g: GroupPlan) -> List[str]:
    lines = [f"# component {g.component}: {g.role} ({g.tasks} task{'s' if g.tasks != 1 else ''})"]
    n = plan.nodes_per_instance
    if g.role == "inference" and n > 1:
        lines.append(f"# one vLLM instance over {n} nodes per worker: {g.tasks // n} workers x {n} tasks, one a node; "
                     f"task t is worker t // {n}, vLLM node rank t % {n} (0: the leader, the others: followers)")
    for key, value in (("partition", plan.partition), ("account", plan.account), ("qos", plan.qos)):
        if value:
            lines.append(_sbatch(key, value))
    lines += [
        _sbatch("time", g.time_min),
        _sbatch("nodes", g.nodes),
        _sbatch("ntasks-per-node", g.tasks_per_node),
        _sbatch("cpus-per-task", g.cpus_per_task),
    ]
    if g.gpus_per_node:
        lines.append(_sbatch("gpus-per-node", g.gpus_per_node))
    if g.mem_gb:
        lines.append(_sbatch("mem", f"{g.mem_gb}G"))
    lines += [_sbatch(k.replace("_", "-"), v) for k, v in sorted(g.extra.items())]
    return lines


# Each task: find its log name (role-rank) from Slurm's variables, then run the role entry point. An inference worker
# (or a follower of its instance: rlhpc/infer/follower.py) that dies while the run goes on (killed, crashed; not
# stopped by a signal, the run not DONE or FAILED) is started again inside the job by the policy of
# rlhpc.cluster.restarts, here in bash: at most inference.max_restarts times within inference.restart_window_s (whole
# seconds), after a back-off that doubles with each of them (awk does the arithmetic, up to 60 s), and not again when it
# dies the same way as last time (exit code and last log line, numbers aside) without a heartbeat since it started
# (the heartbeat file's modification time, whole seconds). A worker it gives up on makes its error (status/<name>.error,
# or its exit code when it left none) the run's status/FAILED, unless one is there or the worker is attached
# (rlhpc.cluster.attach), and its task fails the job.
# It rejoins at the newest weights. Slurm signals every process of the step (measured: srun's forwarded USR1 reaches
# this shell and the role once each), so the shell only notes a signal (a stopped role is not restarted; a back-off
# ends early) and the role handles it itself.
_TASK = (
    'name=$("$RLHPC_PYTHON" -m rlhpc.run.slurm_identity) || exit 1; export LOCAL_RANK=$SLURM_LOCALID; '
    'st=$RLHPC_RUN_DIR/status; log=$RLHPC_RUN_DIR/logs/$name.log; '
    'RLHPC_ATTACH=${RLHPC_ATTACH:-0}; max=0; [[ $name == inference-* || $name == follower-* ]] && max=$RLHPC_MAX_RESTARTS; n=0; stopped=""; '
    'deaths=""; last=""; '
    'trap "stopped=1" USR1 TERM INT; '
    'while true; do '
    'rm -f "$st/$name.error"; start=$(date +%s%N); '
    'RLHPC_RESTART=$n RLHPC_RESTARTS_LEFT=$max "$RLHPC_PYTHON" -m rlhpc.role >>"$log" 2>&1; '
    'code=$?; '
    '[[ $code == 0 || $code == 75 || -n $stopped || $max == 0 || -e $st/DONE || -e $st/FAILED ]] && exit $code; '
    'now=$(date +%s); '
    'line=$(tail -n 20 "$log" | grep -v "^[[:space:]]*$" | tail -n 1 | sed -E "s/^[0-9-]+ [0-9:,]+ //"); '
    'beat=$(stat -c %.9Y "$st/$name.json" 2>/dev/null | tr -d .); beat=${beat:-0}; '
    'recent=""; for t in $deaths $now; do '
    '(( RLHPC_RESTART_WINDOW_S == 0 || t > now - RLHPC_RESTART_WINDOW_S )) && recent="$recent $t"; done; '
    'deaths=$recent; count=$(echo $deaths | wc -w); why=""; '
    'same="$code $(sed -E "s/[0-9]+/#/g" <<<"$line")"; '
    'if (( beat < start )) && [[ $same == "$last" ]]; then '
    'why="it crashed the same way at two starts in a row (exit code $code, last log line: $line) without doing any '
    'work in between: it would crash at every start, so it is not restarted again; fix the cause (its log), then '
    'resubmit the job script to resume"; '
    'elif (( count > max )); then '
    'why="it died $count times within inference.restart_window_s=${RLHPC_RESTART_WINDOW_S}s, more '
    'than inference.max_restarts=$max restarts allow: raise inference.max_restarts (or lower '
    'inference.restart_window_s) to restart it more often; its log tells why it dies"; fi; '
    'last=$same; '
    'if [[ -n $why ]]; then '
    'echo "rlhpc: $name exited with code $code on $(hostname); not restarting it: $why" >&2; '
    'if [[ $RLHPC_ATTACH != 1 ]]; then [[ -e $st/$name.error ]] || printf "{\\"role\\": \\"%s\\", \\"rank\\": %s, \\"error\\": \\"exited with code %s '
    '(no Python error: killed from outside, or crashed) and was not restarted\\"}\\n" "${name%-*}" "${name##*-}" '
    '"$code" >"$st/$name.error"; '
    'ln "$st/$name.error" "$st/FAILED" 2>/dev/null; fi; exit $code; fi; '
    'n=$((n + 1)); '
    'delay=$(awk -v b="$RLHPC_RESTART_BACKOFF_S" -v k="$count" '
    '"BEGIN { d = b * 2 ^ (k - 1); c = (b > 60 ? b : 60); print (d > c ? c : d) }"); '
    'echo "rlhpc: $name exited with code $code on $(hostname); restarting it ($count of inference.max_restarts=$max) '
    'in ${delay}s" >&2; '
    'sleep "$delay" & wait $!; kill $! 2>/dev/null; '
    '[[ -n $stopped || -e $st/DONE || -e $st/FAILED ]] && exit $code; '
    'done'
)

_BODY = r"""
status="$RLHPC_RUN_DIR/status"
mkdir -p "$RLHPC_RUN_DIR/logs" "$status"
# Markers of an earlier attempt (one Slurm requeued itself: preemption, scontrol requeue) would stop this one.
rm -f "$status/REQUEUE" "$status/FAILED"
echo "rlhpc: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): trainer on $SLURM_JOB_NODELIST_HET_GROUP_0," \
     "inference on $SLURM_JOB_NODELIST_HET_GROUP_1; logs in $RLHPC_RUN_DIR/logs" >&2

# Slurm signals this shell only (--signal=B:USR1@grace, scancel --signal=USR1 --batch, SIGTERM on cancel/preemption):
# pass the signal on to the roles. The trainer finishes its step, checkpoints, writes status/REQUEUE and exits 75;
# the inference workers exit.
signalled=""
interrupted=0
forward() {
    signalled=$1
    interrupted=1
    echo "rlhpc: batch shell got SIG$1; forwarding it to the roles" >&2
    kill -s "$1" "$srun_pid" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

__SRUN__ &
srun_pid=$!
rc=0
while true; do  # a trap ends `wait` early: wait again until srun itself has ended
    interrupted=0
    wait "$srun_pid"
    code=$?
    [[ $code == 127 ]] && break  # srun's status was already collected
    rc=$code
    [[ $interrupted == 1 ]] || break
done

if [[ -f "$status/REQUEUE" ]]; then
    # A requeue that would resume where the last one did (the step of REQUEUE unchanged, and the SFT step of a warm
    # start stopped before its end) makes no progress: the allocation is too short for the start-up and a step.
    step=$(tr -d '\n ' <"$status/REQUEUE" | sed -n 's/.*"step":\([0-9]*\).*/\1/p')
    sft=$(tr -d '\n ' <"$status/REQUEUE" | sed -n 's/.*"sft_step":\([0-9]*\).*/\1/p')
    [[ -n $step && -n $sft ]] && step="$step (SFT step $sft)"
    last=$(cat "$status/requeued_at_step" 2>/dev/null)
    if [[ $RLHPC_REQUEUE == 1 && $signalled != TERM && -n $step && $step == "$last" ]]; then
        echo "rlhpc: this attempt stopped at step $step, where the last requeue left off: no progress, so job" \
             "$SLURM_JOB_ID is not requeued again. The time from the start to the signal (cluster.time_min minus" \
             "cluster.grace_s, and Slurm may signal up to 60 s early) is too short for the start-up, the warm start" \
             "and a checkpoint: raise cluster.time_min or lower cluster.grace_s, then resume with" \
             "sbatch $RLHPC_RUN_DIR/job.sbatch" >&2
        rm -f "$status/REQUEUE" "$status/requeued_at_step"
        exit 1
    elif [[ $RLHPC_REQUEUE == 1 && $signalled != TERM ]]; then
        echo "rlhpc: the trainer checkpointed ($(tr -d '\n ' <"$status/REQUEUE")); requeueing job $SLURM_JOB_ID" >&2
        rm -f "$status/REQUEUE"
        echo "$step" >"$status/requeued_at_step"
        scontrol requeue "$SLURM_JOB_ID" && exit 0
        echo "rlhpc: scontrol requeue $SLURM_JOB_ID failed; resubmit to resume: sbatch $RLHPC_RUN_DIR/job.sbatch" >&2
    elif [[ $signalled != TERM ]]; then
        echo "rlhpc: the trainer checkpointed; cluster.requeue is off: resume with sbatch $RLHPC_RUN_DIR/job.sbatch" >&2
    else  # cancelled (or preempted: Slurm requeues such a job itself): no requeue of ours is coming
        rm -f "$status/REQUEUE"
    fi
elif [[ $rc != 0 ]]; then
    echo "rlhpc: the roles ended with exit code $rc" >&2
    # The batch shell runs on the host: in a container (cluster.container) cluster.python is the image's.
    if command -v "$RLHPC_PYTHON" >/dev/null; then
        "$RLHPC_PYTHON" -m rlhpc.status "$RLHPC_RUN_DIR" --no-slurm >&2
    else
        echo "rlhpc: where the run stands: rlhpc-status $RLHPC_RUN_DIR (with rlhpc's Python)" >&2
    fi
fi
exit $rc
"""


# srun's options of the step that starts every task of both components (a task learns its role from Slurm's
# variables: rlhpc.run.slurm_identity).
HET_STEP = ["--het-group=0,1", "--kill-on-bad-exit=1", "--unbuffered"]


def srun_line(plan: JobPlan, options: List[str]) -> str:
    """The srun command that starts every task of the plan's components: rlhpc's `options`, then cluster.srun_args,
    then cluster.container's (pyxis: srun's own options; Apptainer: `apptainer exec ... IMAGE` before the task),
    and the task loop, `bash -c '<_TASK>'` (_TASK holds no single quote)."""
    gpus = any(g.gpus_per_node for g in plan.groups)
    words = ["srun", *options, *plan.srun_args, *container.srun_options(plan.container, plan.run_dir),
             *container.command_prefix(plan.container, plan.run_dir, gpus), "bash", "-c"]
    return " ".join(map(shlex.quote, words)) + f" '{_TASK}'"


def start_lines(plan: JobPlan, options: List[str]) -> List[str]:
    """The dry run's lines on how the tasks start: the srun line (its task loop elided), and the container."""
    head = srun_line(plan, options).partition(" -c '")[0]
    return [f"  tasks start with: {head} -c '<task loop>'",
            *container.describe(plan.container, plan.run_dir, plan.python)]


# The line of a job script that names its run directory (render_script, attach.py's script; script_run_dir reads it).
RUN_DIR_LINE = "export RLHPC_RUN_DIR="


def run_dir_line(run_dir: Path) -> str:
    return f"{RUN_DIR_LINE}{shlex.quote(str(run_dir))}"


def script_run_dir(script: str) -> Optional[str]:
    """The run_dir that a job script rlhpc wrote names (its RUN_DIR_LINE), or None if it names none."""
    for line in script.splitlines():
        if line.startswith(RUN_DIR_LINE):
            try:
                return shlex.split(line[len(RUN_DIR_LINE):])[0]
            except (ValueError, IndexError):
                return None  # not a line rlhpc wrote
    return None


def render_script(plan: JobPlan, exp_name: str = "") -> str:
    header = [
        "#!/bin/bash",
        f"# rlhpc: one heterogeneous job{f' for experiment {exp_name}' if exp_name else ''}; run_dir {plan.run_dir}",
        "# Written by `python -m rlhpc.launch ... launcher=slurm|sbatch`; resubmit it as is with `sbatch <this file>`.",
        _sbatch("job-name", plan.name),
        _sbatch("output", plan.run_dir / "logs" / "slurm-%j.out"),
        _sbatch("open-mode", "append"),
        _sbatch("signal", f"B:USR1@{plan.grace_s}"),
        _sbatch("requeue") if plan.requeue else _sbatch("no-requeue"),
    ]
    header += _component_lines(plan, plan.trainer)
    header += ["#SBATCH hetjob"]
    header += _component_lines(plan, plan.inference)
    env = [
        "",
        run_dir_line(plan.run_dir),
        f"export RLHPC_PYTHON={shlex.quote(plan.python)}",
        f"export RLHPC_REQUEUE={int(plan.requeue)}",
        f"export RLHPC_MAX_RESTARTS={plan.max_restarts}",
        f"export RLHPC_RESTART_WINDOW_S={plan.restart_window_s}",
        f"export RLHPC_RESTART_BACKOFF_S={plan.restart_backoff_s:g}",
        # inference.nodes_per_instance: rlhpc.run.slurm_identity reads it to tell a worker from its followers
        f"export RLHPC_NODES_PER_INSTANCE={plan.nodes_per_instance}",
        "export PYTHONUNBUFFERED=1",
    ]
    if plan.trainer.gpus_per_node or plan.inference.gpus_per_node:
        env += ["# GPUs: every task sees its node's GPUs (--gpus-per-node) and takes its own by SLURM_LOCALID, exported",
                "# as LOCAL_RANK below: trainer rank -> cuda:LOCAL_RANK, inference worker -> its engine's GPUs."]
    if plan.setup:
        env += ["", "# cluster.setup"] + list(plan.setup)
    env += ["", "set -u"]  # after the setup lines: activation scripts often read unset variables
    return "\n".join(header + env) + "\n" + _BODY.replace("__SRUN__", srun_line(plan, HET_STEP))


# ---- the plan as a user reads it -------------------------------------------------------------------------------


def gpu_binding(plan: JobPlan, cfg: Config) -> List[str]:
    """Which GPUs each task computes on. Every task sees all of its node's GPUs (`--gpus-per-node`, not
    `--gpus-per-task`: a vLLM worker with tensor_parallel_size > 1 needs several, and trainer ranks of one node reach
    each other's GPUs for NCCL's peer-to-peer paths) and takes its own by its rank on the node, SLURM_LOCALID, which
    the task exports as LOCAL_RANK (docs/gpu.md)."""
    lines = []
    if plan.trainer.gpus_per_node:
        lines.append(f"  GPUs: trainer rank -> cuda:LOCAL_RANK (1 of {plan.trainer.gpus_per_node} per node), NCCL")
    if plan.inference.gpus_per_node:
        inf, pd = cfg.inference, cfg.inference.disaggregation
        per = inf.tensor_parallel_size if inf.engine == "vllm" else 1
        per += (pd.prefill_tensor_parallel_size or per) if pd.enabled else 0  # prefill and decode instances
        n = inf.nodes_per_instance
        if n > 1:
            lines.append(f"  GPUs: inference instance -> tp {per} over {n} nodes, all {per // n} GPUs of each of "
                         "its nodes (one task a node)")
        else:
            lines.append(f"  GPUs: inference worker -> {per} GPU(s) from LOCAL_RANK x {per} "
                         f"(of {plan.inference.gpus_per_node} per node)")
    return lines


def instance_nodes(cfg: Config) -> List[str]:
    """Which tasks (one a node) of the inference component make each instance, when an instance spans nodes: task t
    is worker t // N's vLLM node rank t % N (N = inference.nodes_per_instance; rlhpc.run.slurm_identity)."""
    n, workers = cfg.inference.nodes_per_instance, cfg.inference.num_workers
    if n <= 1:
        return []
    lines = [f"  instances over {n} nodes: task t of component 1 (one a node) is worker t // {n}, vLLM node rank "
             f"t % {n}; node rank 0 is the leader (the rlhpc worker), the others followers (vLLM's headless model "
             "workers)"]
    shown = range(workers) if workers <= 4 else [0, 1, None, workers - 1]
    for w in shown:
        if w is None:
            lines.append("    ...")
            continue
        first, last = w * n, w * n + n - 1
        followers = f"{first + 1}" if n == 2 else f"{first + 1}-{last}"
        lines.append(f"    instance {w}: nodes {first}-{last} of component 1, leader on {first}, "
                     f"follower{'s' if n > 2 else ''} on {followers}")
    return lines


def describe(plan: JobPlan, cfg: Config, launcher: str) -> str:
    where = ", ".join(f"{k} {v}" for k, v in (("partition", plan.partition), ("account", plan.account),
                                               ("qos", plan.qos)) if v)
    lines = [
        f"launcher={launcher}: one heterogeneous Slurm job `{plan.name}`{f' ({where})' if where else ''}",
        f"  run_dir: {plan.run_dir}",
    ]
    n = cfg.inference.nodes_per_instance
    for g in plan.groups:
        if g.role == "trainer":
            unit = "rank(s)"
        else:
            unit = "worker(s)" if n == 1 else f"task(s): {cfg.inference.num_workers} worker(s) x {n} nodes"
        lines.append(
            f"  component {g.component} {g.role:<9} {g.nodes} node(s) x {g.tasks_per_node} task(s) = "
            f"{g.tasks} {unit}; "
            f"{g.cpus_per_task} CPU(s)/task, {g.gpus_per_node} GPU(s)/node, "
            f"{f'{g.mem_gb} GB/node' if g.mem_gb else 'default memory'}, {g.time_min} min"
        )
    w = cfg.weights
    lines += [
        f"  inference engine: {cfg.inference.engine} (tensor_parallel_size {cfg.inference.tensor_parallel_size}, "
        f"engines_per_node {cfg.inference.engines_per_node}, nodes_per_instance {n}, "
        f"weights {cfg.inference.quantization or cfg.model.dtype}, "
        f"kv cache {cfg.inference.kv_cache_dtype}"
        + (f", kv_transfer_config {dict(cfg.inference.kv_transfer_config)}" if cfg.inference.kv_transfer_config
           else "") + ")",
        *gpu_binding(plan, cfg),
        *instance_nodes(cfg),
        f"  weights group: {cfg.inference.num_workers + 1} members (trainer rank 0 + {cfg.inference.num_workers} "
        f"inference workers{', the leaders' if n > 1 else ''}), transport {w.transport}",
        f"  steps: sft={cfg.sft.steps} rl={cfg.trainer.steps} async_level={cfg.async_level} "
        f"groups_per_step={cfg.trainer.groups_per_step}",
        f"  preemption: SIGUSR1 {plan.grace_s}s before the time limit -> checkpoint, "
        + ("requeue" if plan.requeue else "stop (cluster.requeue=false)"),
        *start_lines(plan, HET_STEP),
        "",
        "----- job script -----",
        render_script(plan, cfg.exp_name),
    ]
    return "\n".join(lines)
