"""The sbatch launcher: the same heterogeneous job script as launcher=slurm, submitted with the plain `sbatch` command.

`launcher=sbatch` renders run_dir/job.sbatch for any composed config and submits it (`launcher.submit=false`: only
writes it, for `sbatch run_dir/job.sbatch` by hand, or for sbatch/rlhpc.sbatch which runs it inside its own
allocation); `dry_run=true` prints the plan and the script and submits nothing. Following the job
(`launcher.wait=true`), run_dir/jobs.json and sweeps work as with launcher=slurm.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from rlhpc.cluster.slurm_launcher import SlurmLauncher, SubmissionError
from rlhpc.run.rundir import RunDir


class SbatchLauncher(SlurmLauncher):
    """The same job script, submitted with the plain `sbatch` command."""

    name = "sbatch"

    def submit(self, run: RunDir, script: Path) -> str:
        try:
            proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
        except FileNotFoundError as e:
            raise SubmissionError("launcher=sbatch needs the `sbatch` command on this machine; dry_run=true shows the "
                                  "job without submitting it") from e
        if proc.returncode != 0:
            raise SubmissionError(f"sbatch refused {script}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]
