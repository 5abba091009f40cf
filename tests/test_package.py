"""rlhpc as a package: a wheel built from the repository carries the folders the commands read (conf/, envs/, sbatch/)
and every command, and an installed copy finds them without the repository; users add config folders and environments
of their own without editing either. .ci/run installs the wheel in a fresh venv and runs the quick start with it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlhpc.commands import COMMANDS
from rlhpc.config import shipped

REPO = Path(__file__).resolve().parents[1]
# The three wheel tests share one build (a module fixture), ~8 s of pip's isolated build on 2 cores.
SLOW_WHEEL = pytest.mark.slow  # over 10 s here: 11 s for this file, 8 s of it building the wheel


def git_files(*folders: str) -> list[str]:
    """The files of the checkout under `folders` as git has them (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return sorted(p for p in out.splitlines() if (REPO / p).is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel `pip wheel --no-deps` builds from a copy of the checkout's files (a build in place would leave
    build/ behind, whose stale files a later build can carry)."""
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the files the wheel must carry are git's)")
    tmp = tmp_path_factory.mktemp("wheel")
    source, dist = tmp / "source", tmp / "dist"
    for path in git_files():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, source / path)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = dist.glob("rlhpc-*.whl")
    with zipfile.ZipFile(built) as z:
        yield z


@SLOW_WHEEL
def test_the_wheel_carries_every_file_of_conf_envs_and_sbatch_unchanged(wheel):
    files = git_files("conf", "envs", "sbatch")
    assert {"conf/config.yaml", "envs/reverse_text.py", "sbatch/rlhpc.sbatch"} <= set(files)
    carried = {name[len("rlhpc/data/"):] for name in wheel.namelist() if name.startswith("rlhpc/data/")}
    assert sorted(carried) == files
    assert [f for f in files if wheel.read(f"rlhpc/data/{f}") != (REPO / f).read_bytes()] == []


@SLOW_WHEEL
def test_the_wheel_carries_every_module_of_the_package(wheel):
    # setup.cfg lists the packages by name: a new folder of rlhpc/ missing there would be left out of the wheel.
    assert sorted(set(git_files("rlhpc")) - set(wheel.namelist())) == []


@SLOW_WHEEL
def test_the_wheel_installs_every_command_as_a_console_script(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    cfg = configparser.ConfigParser()
    cfg.read_string(wheel.read(entry_points).decode())
    assert dict(cfg["console_scripts"]) == {c.script: c.entry for c in COMMANDS}


def test_an_installed_copy_of_a_folder_wins_over_one_beside_the_package(tmp_path, monkeypatch):
    # An installed wheel lives in site-packages, where an unrelated conf/ may lie beside it.
    (tmp_path / "rlhpc" / "data" / "conf").mkdir(parents=True)
    (tmp_path / "conf").mkdir()
    monkeypatch.setattr(shipped, "PACKAGE", tmp_path / "rlhpc")
    assert shipped.folder("conf") == tmp_path / "rlhpc" / "data" / "conf"
    assert shipped.folder("envs") == tmp_path / "envs"  # no installed copy: the repository's folder


def test_a_checkout_finds_its_own_top_level_folders():
    assert shipped.folder("conf") == REPO / "conf" and shipped.folder("envs") == REPO / "envs"
    assert shipped.folder("sbatch") == REPO / "sbatch"


def test_an_environment_in_a_folder_of_RLHPC_ENVS_DIR_is_found_before_the_shipped_ones(tmp_path, monkeypatch):
    from rlhpc.config.schema import EnvConfig
    from rlhpc.env.base import ENVS_DIR, env_dirs, load

    (tmp_path / "shout.py").write_text(
        "from rlhpc.env import Environment\n\n"
        "class Shout(Environment):\n"
        "    name = 'shout'\n"
        "    def tasks(self, split, seed): return iter(())\n"
        "    def messages(self, task): return []\n")
    monkeypatch.setenv("RLHPC_ENVS_DIR", str(tmp_path))
    assert env_dirs() == [tmp_path, ENVS_DIR]
    assert type(load(EnvConfig(name="shout"))).__name__ == "Shout"
    assert type(load(EnvConfig(name="reverse_text"))).__name__ == "ReverseText"  # the shipped ones still there


def test_an_experiment_in_a_config_folder_of_the_users_composes(tmp_path):
    from rlhpc.config.errors import composition_error
    from rlhpc.config.schema import register

    register()
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - reverse_text\nexp_name: mine\n")
    assert composition_error([f"hydra.searchpath=[file://{tmp_path}]", "+exp=mine"]) is None
    assert "no option 'mine'" in composition_error(["+exp=mine"])
