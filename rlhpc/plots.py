"""Plots of a run (or several): `python -m rlhpc.plots RUN_DIR [RUN_DIR ...] [--out PNG]`.

Left: the SFT loss per warm-start step. Right: held-out reward (greedy) against RL step, with the training rollouts'
mean reward faded behind it. Reads logs/trainer-0.metrics.jsonl and summary.json (a run still going: run_dir/evals/,
the held-out results, written by rlhpc/run/evaluation.py). A file it cannot read (a run still writing it, or a
damaged one) is left out with a note on stderr; a path that is not a run directory, or labels that do not match the
runs, is an error before anything is drawn. The plot goes to `--out`, by default `curves.png` in the first RUN_DIR
(beside the run it shows, whichever folder the command runs in); the path written is printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rlhpc.run.metrics import read_rows
from rlhpc.run.rundir import RunDir, is_number, read_json_object


class PlotError(ValueError):
    """What the caller asked for cannot be plotted (the message names the argument)."""


def check_runs(run_dirs: List[Path], labels: Optional[List[str]] = None) -> None:
    """Raises PlotError unless every path is a run directory (it holds the config.yaml rlhpc.launch writes first; a
    mistyped path would otherwise give an empty plot) and there is one label per run (when labels are given)."""
    for d in run_dirs:
        if not d.exists():
            raise PlotError(f"run directory {d} does not exist")
        if not RunDir(d).config.exists():
            raise PlotError(f"{d} is not a run directory (no config.yaml written by rlhpc.launch)")
    if labels and len(labels) != len(run_dirs):
        raise PlotError(f"--labels: {len(labels)} label(s) for {len(run_dirs)} run(s); give one per run directory")


def _read(path: Path, numbers: Tuple[str, ...] = ()) -> Optional[Dict[str, Any]]:
    """The JSON object in `path`, or None: one that a run still going is writing, or a damaged one, is left out with a
    note (rlhpc.run.rundir.read_json_object)."""
    problems: Dict[Path, str] = {}
    value = read_json_object(path, problems, numbers)
    for p, why in problems.items():
        _note(p, why)
    return value


def _note(path: Path, why: str) -> None:
    print(f"note: {path}: {why}; left out of the plot", file=sys.stderr)


def _rows(run: RunDir) -> List[dict]:
    """The trainer's metrics rows as rlhpc.run.metrics writes them (numbers only); other rows left out, with a note."""
    rows = read_rows(run, "trainer", 0)
    good = [r for r in rows if isinstance(r, dict) and is_number(r.get("step")) and all(map(is_number, r.values()))]
    if len(good) < len(rows):
        _note(run.logs / "trainer-0.metrics.jsonl", f"{len(rows) - len(good)} row(s) not numbers only")
    return good


def plot_runs(run_dirs: List[Path], out: Path, labels: Optional[List[str]] = None, title: str = "") -> Path:
    check_runs(run_dirs, labels)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_of = {d: _rows(RunDir(d)) for d in run_dirs}
    with_sft = any("sft/loss" in r for rows in rows_of.values() for r in rows)
    if with_sft:
        fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(12, 4.5))
    else:  # RL only (e.g. from model.path with sft.steps=0)
        fig, ax_rl = plt.subplots(1, 1, figsize=(7, 4.5))
        ax_sft = None
    for i, d in enumerate(run_dirs):
        run = RunDir(d)
        rows = rows_of[d]
        summary = _read(run.summary) or {}
        label = labels[i] if labels else summary.get("algo", d.name)
        sft = [(r["step"], r["sft/loss"]) for r in rows if "sft/loss" in r]
        if sft and ax_sft is not None:
            ax_sft.plot([k for k, _ in sft], [v for _, v in sft], label=f"{label} loss", lw=1)
        val = [(r["step"], r["sft/validation_reward"]) for r in rows if "sft/validation_reward" in r]
        if val and ax_sft is not None:
            ax_val = ax_sft.twinx()
            ax_val.plot([k for k, _ in val], [v for _, v in val], color="tab:green", marker=".", lw=1,
                        label="validation reward (greedy)")
            ax_val.set(ylabel="reward", ylim=(0, 1))
            ax_val.legend(fontsize=8, loc="center right")
        # The held-out curve: (weights version, reward); version v is the policy after RL step v.
        curve = (summary.get("eval_curve")
                 or sorted((e["version"], e["reward"]) for e in (_read(p, ("version", "reward"))
                                                                 for p in (run.root / "evals").glob("v*.json")) if e)
                 or [(r["step"], r["eval/heldout_reward"]) for r in rows if "eval/heldout_reward" in r])
        (line,) = ax_rl.plot([s for s, _ in curve], [v for _, v in curve], marker="o", ms=3, label=f"{label} held-out (greedy)")
        train = [(r["step"], r["rollout/reward"]) for r in rows if "rollout/reward" in r]
        if train:
            ax_rl.plot([s for s, _ in train], [v for _, v in train], color=line.get_color(), alpha=0.25, lw=1)
    if ax_sft is not None:
        ax_sft.set(title="SFT warm start (stops at partial competence)", xlabel="SFT step", ylabel="loss")
    ax_rl.set(title="RL (faded: training rollouts' mean reward)", xlabel="RL step", ylabel="reward", ylim=(0, 1))
    for ax in (a for a in (ax_sft, ax_rl) if a is not None):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "the plot was written (its path is printed)",
    2: "a path is not a run directory, the labels do not match the runs, --out cannot be written, or the arguments "
       "are wrong",
}


def parser() -> argparse.ArgumentParser:
    from rlhpc.config.commandline import argparser

    ap = argparser("rlhpc-plots", __doc__, EXIT_CODES)
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                    help="a run directory (run_dir=... of a launch)")
    ap.add_argument("--out", type=Path, help="the PNG to write (default: curves.png in the first RUN_DIR)")
    ap.add_argument("--labels", nargs="*", help="one label per RUN_DIR (default: each run's algorithm or folder name)")
    ap.add_argument("--title", default="", help="a title over the plot")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    out = args.out or args.run_dirs[0] / "curves.png"
    try:
        print(plot_runs(args.run_dirs, out, args.labels, args.title))
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # another user's run directory, read-only here
        why = f"{e.filename} is a file, not a folder" if isinstance(e, FileExistsError) else e.strerror or e
        print(f"error: --out: cannot write {out}: {why}; name another file with --out", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
