"""Chaos, measured: faults injected into a run, faults survived, groups lost and duplicated, and the final held-out
reward next to an undisturbed run of the same seed.

    python benchmarks/chaos.py                       # one undisturbed and one disturbed run (~5 min on 2 cores)
    python benchmarks/chaos.py --repeats 3           # the spread of both, as docs/changelog.md reports it
    python benchmarks/chaos.py --model runs/x/model  # start RL from this SFT model instead of training one

The faults are those of tests/test_chaos.py (tests/faults.py): three `kill -9` of inference workers, one of the
trainer (the run is launched again and resumes from its checkpoint), two corrupted queue files, a worker frozen for
4 s, each at a seeded random moment. Runs go under --work (a temporary folder by default, removed at the end).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the faults and their accounting

from faults import LocalChaos, account, heldout, rl_overrides, survived, warm_start  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=70, help="RL steps of each run (default 70, as the test)")
    ap.add_argument("--checkpoint-interval", type=int, default=10)
    ap.add_argument("--transport", default="broadcast", choices=["broadcast", "filesystem"], help="weights.transport")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (undisturbed, disturbed)")
    ap.add_argument("--seed", type=int, default=0, help="moments of the faults; repeat r uses seed + r")
    ap.add_argument("--model", type=Path, help="an SFT model folder to start RL from (default: train one)")
    ap.add_argument("--work", type=Path, help="where the runs go (default: a temporary folder, removed)")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="rlhpc-chaos-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        model = a.model or warm_start(work / "sft")
        print(f"warm start: {model} ({time.time() - t0:.0f}s)", flush=True)
        base = [sys.executable, "-m", "rlhpc.launch", *rl_overrides(model, a.steps, a.checkpoint_interval, transport=a.transport)]
        rows = []
        for r in range(a.repeats):
            t0 = time.time()
            calm_dir = work / f"calm-{r}"
            calm = subprocess.run([*base, f"run_dir={calm_dir}"], capture_output=True, text=True, timeout=1800)
            if calm.returncode != 0:
                print(f"undisturbed run {r} failed:\n{calm.stderr[-3000:]}", file=sys.stderr)
                return 1
            t1 = time.time()
            run_dir = work / f"chaos-{r}"
            chaos = LocalChaos([*base, f"run_dir={run_dir}"], run_dir, a.steps, a.checkpoint_interval, seed=a.seed + r)
            code = chaos.run()
            faults = survived(chaos.faults, run_dir, completed=code == 0, log_text=chaos.output)
            groups = account(run_dir, chaos.snapshots)
            ok_steps = groups.steps == list(range(a.steps))
            print(f"\nrepeat {r} (fault seed {a.seed + r}): undisturbed {t1 - t0:.0f}s, disturbed {time.time() - t1:.0f}s"
                  f" (exit {code}; trainer resumed from step {chaos.resumed_from})")
            for f in faults:
                print(f"  {f.kind:<14} {f.target:<40} at step {f.at_step:>3}  "
                      f"{'survived' if f.survived else 'NOT survived'}")
            print(f"  {groups.line()}; ledger steps 0..{a.steps - 1} once each: {'yes' if ok_steps else 'NO'}")
            h_calm, h_chaos = heldout(calm_dir), heldout(run_dir)
            print(f"  held-out reward: warm start {h_calm['sft']:.3f}, undisturbed {h_calm['rl']:.3f}, "
                  f"disturbed {h_chaos['rl']:.3f} (difference {h_chaos['rl'] - h_calm['rl']:+.3f})", flush=True)
            rows.append((faults, groups, h_calm, h_chaos, ok_steps))

        injected = sum(len(f) for f, *_ in rows)
        ok = sum(1 for f, *_ in rows for x in f if x.survived)
        print(f"\nfaults injected: {injected}\nfaults survived: {ok}")
        print(f"groups lost: {sum(len(g.lost) for _, g, *_ in rows)}")
        print(f"groups duplicated: {sum(len(g.duplicated) for _, g, *_ in rows)}")
        calm_r = [h["rl"] for _, _, h, _, _ in rows]
        chaos_r = [h["rl"] for *_, h, _ in rows]
        print(f"held-out reward, warm start: {rows[0][2]['sft']:.3f}")
        print(f"held-out reward, undisturbed: {' '.join(f'{x:.3f}' for x in calm_r)}"
              + (f" (mean {statistics.mean(calm_r):.3f}, range {max(calm_r) - min(calm_r):.3f})" if a.repeats > 1 else ""))
        print(f"held-out reward, disturbed:   {' '.join(f'{x:.3f}' for x in chaos_r)}"
              + (f" (mean {statistics.mean(chaos_r):.3f}, range {max(chaos_r) - min(chaos_r):.3f})" if a.repeats > 1 else ""))
        print(f"largest |disturbed - undisturbed| of a pair: {max(abs(c - u) for c, u in zip(chaos_r, calm_r)):.3f}")
        all_ok = ok == injected and all(not g.lost and not g.duplicated and s for _, g, _, _, s in rows)
        return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
