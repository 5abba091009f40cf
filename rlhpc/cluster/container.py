"""The container the roles run in on Slurm (`cluster.container`), as words of the srun line that starts them.

pyxis (NVIDIA's pyxis/enroot) is a plugin of srun: the image and mounts are srun's own options, and srun starts the
task's command inside the image. Apptainer (or Singularity) is a program: srun starts `apptainer exec ... IMAGE`,
which runs the task's command inside the image. Either way run_dir is mounted at its own path (the roles write there,
the launcher and rlhpc.status read it from outside), and the task's command is the same as without a container.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from rlhpc.config.schema import ContainerConfig


def mounts(c: ContainerConfig, run_dir: Path) -> List[str]:
    """cluster.container.mounts, and run_dir at its own path unless one of them mounts it already."""
    given = list(c.mounts)
    if not any(m.split(":")[0].rstrip("/") == str(run_dir) for m in given):
        given.append(f"{run_dir}:{run_dir}")
    return given


def srun_options(c: ContainerConfig, run_dir: Path) -> List[str]:
    """pyxis: the options of srun that start every task in the image; none for another runtime."""
    if c.runtime != "pyxis":
        return []
    options = [f"--container-image={c.image}", f"--container-mounts={','.join(mounts(c, run_dir))}"]
    if c.workdir:
        options.append(f"--container-workdir={c.workdir}")
    return options


def command_prefix(c: ContainerConfig, run_dir: Path, gpus: bool) -> List[str]:
    """Apptainer: the words before the task's command, `apptainer exec [--nv] --bind ... IMAGE`; none for another
    runtime. `gpus`: a component of the job has GPUs (--nv brings the host's NVIDIA driver into the image; on a node
    without GPUs Apptainer only warns)."""
    if c.runtime != "apptainer":
        return []
    words = [c.exe, "exec", *(["--nv"] if gpus else []), "--bind", ",".join(mounts(c, run_dir))]
    if c.workdir:
        words += ["--pwd", c.workdir]
    return words + [c.image]


def describe(c: ContainerConfig, run_dir: Path, python: str) -> List[str]:
    """The dry run's lines about the container: which image, what is mounted, and that cluster.python is the image's
    (which this machine cannot check)."""
    if not c.runtime:
        return []
    how = "srun's --container-image" if c.runtime == "pyxis" else f"{c.exe} exec"
    return [
        f"  container: {c.runtime} image {c.image} ({how}); mounts {', '.join(mounts(c, run_dir))}"
        + (f"; workdir {c.workdir}" if c.workdir else ""),
        f"  note: cluster.python={python} is the Python inside the image: not checked on this machine; the image "
        "must have rlhpc installed",
    ]
