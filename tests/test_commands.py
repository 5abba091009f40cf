"""The reference of every command (rlhpc.commands) as a user meets it: `--help` of each entry point, docs/commands.md
and the console scripts, all made from the typed config and the entry points, so that none can drift from the code."""

from __future__ import annotations

import ast
import configparser
import importlib
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import MISSING

from rlhpc import commands
from rlhpc.commands import COMMANDS, Command

REPO = Path(__file__).resolve().parents[1]


def run_module(*args: str) -> subprocess.CompletedProcess:
    """`python -m ...` of this checkout's code (not of another installed copy)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def help_of(cmd: Command, flag: str, monkeypatch, capsys) -> str:
    """What the console script prints for `<script> [+attach=inference] <flag>`: its entry function, called as the
    script calls it (no arguments, the command line in sys.argv)."""
    argv = [cmd.script] + (["+attach=inference"] if cmd.name == "attach" else []) + [flag]
    monkeypatch.setattr(sys, "argv", argv)
    module, _, function = cmd.entry.partition(":")
    with pytest.raises(SystemExit) as end:
        getattr(importlib.import_module(module), function)()
    assert end.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("schema", ["rlhpc.config.schema:Config", "rlhpc.eval:EvalCommandConfig"])
def test_every_key_of_the_typed_config_has_a_meaning(schema):
    missing = [k.path for k in commands.keys(schema) if not k.meaning]
    assert not missing, f"keys without a comment above their field: {missing}"


@dataclass
class Planted:
    """A section."""

    # The first line of a meaning
    # and its second line.
    first: int = 1

    # ---- a heading ----
    # Its own meaning.
    second: str = "x"

    # A comment with a blank line after it belongs to no key.

    third: float = 0.5


def test_a_keys_meaning_is_the_comment_block_right_above_its_field():
    (section,) = commands.sections(f"{__name__}:Planted")
    assert section.keys[0].meaning == "The first line of a meaning and its second line."
    assert (section.keys[1].meaning, section.keys[1].heading) == ("Its own meaning.", "a heading")
    assert section.keys[2].meaning == ""


def test_a_nested_sections_defaults_are_its_parents():
    # sft.optim is an OptimConfig made with lr=3e-3: the reference shows that, not the dataclass's own 1e-3.
    by_path = {k.path: k for k in commands.keys()}
    assert by_path["sft.optim.lr"].default == 3e-3
    assert by_path["trainer.optim.lr"].default == 1e-3


def test_docs_commands_md_is_the_reference_made_from_the_code():
    committed = (REPO / "docs" / "commands.md").read_text()
    assert committed == commands.markdown(), "stale: python -m rlhpc.commands --write docs/commands.md"


def test_docs_commands_md_lists_every_key_with_its_type_and_default():
    page = (REPO / "docs" / "commands.md").read_text()
    for k in commands.keys() + commands.keys("rlhpc.eval:EvalCommandConfig"):
        default = commands.default_text(k.default)
        assert f"| `{k.path}` | {k.type} | {default if k.default == MISSING else f'`{default}`'} |" in page, k.path


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.hydra], ids=lambda c: c.name)
def test_help_of_a_config_command_lists_its_groups_keys_and_exit_codes(cmd, monkeypatch, capsys):
    out = help_of(cmd, "--help", monkeypatch, capsys)
    assert out.startswith(f"usage: {cmd.script} ")
    for group in commands.command_groups(cmd):
        assert f"{group}=<name>" in out, group
    for section in commands.command_sections(cmd):
        for k in section.keys:
            assert f"\n  {k.path}: {k.type} = {commands.default_text(k.default)}\n" in out, k.path
    for code in cmd.module.EXIT_CODES:
        assert f"\n  {code:<5}" in out
    assert "powered by Hydra" not in out


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if not c.hydra], ids=lambda c: c.name)
def test_help_of_a_command_without_config_says_what_it_does_and_its_exit_codes(cmd, monkeypatch, capsys):
    out = help_of(cmd, "--help", monkeypatch, capsys)
    assert out.startswith(f"usage: {cmd.script} ")
    assert commands._summary(cmd) in " ".join(out.split())
    for code in cmd.module.EXIT_CODES:
        assert f"\n  {code:<5}" in out


def test_dash_h_is_help_too(monkeypatch, capsys):
    assert help_of(commands.command("launch"), "-h", monkeypatch, capsys) == commands.page("launch") + "\n"


def test_the_help_page_of_attach_is_asked_for_with_attach_on_the_command_line(monkeypatch, capsys):
    out = help_of(commands.command("attach"), "--help", monkeypatch, capsys)
    assert out == commands.page("attach") + "\n"
    assert "trainer.steps" not in out  # the run's config decides training: attach takes no such key


def test_python_m_launch_help_prints_the_reference_not_hydras_page():
    out = run_module("rlhpc.launch", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout == commands.page("launch") + "\n"


def test_hydra_help_still_shows_hydras_flags():
    out = run_module("rlhpc.launch", "--hydra-help")
    assert out.returncode == 0, out.stderr
    assert "--multirun,-m" in out.stdout


def console_scripts() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [ln for ln in cfg["options.entry_points"]["console_scripts"].splitlines() if ln.strip()]
    return {name.strip(): target.strip() for name, _, target in (ln.partition("=") for ln in lines)}


def test_every_command_has_a_console_script_and_every_script_is_a_command():
    assert console_scripts() == {c.script: c.entry for c in COMMANDS}


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_a_console_scripts_target_imports_and_takes_no_arguments(script):
    module, _, function = console_scripts()[script].partition(":")
    target = getattr(importlib.import_module(module), function)
    inspect.signature(target).bind()  # raises TypeError if the script's call, target(), cannot work


def literal_exits(module) -> set:
    """The exit statuses a module gives as literals: sys.exit(N) and os._exit(N) anywhere, `return N` in main."""
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit") and node.args
                and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            found |= {r.value.value for r in ast.walk(node) if isinstance(r, ast.Return)
                      and isinstance(r.value, ast.Constant) and isinstance(r.value.value, int)}
    return found


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_every_literal_exit_status_of_an_entry_point_is_documented(cmd):
    entry = importlib.import_module(cmd.entry.partition(":")[0])
    undocumented = literal_exits(entry) - set(cmd.module.EXIT_CODES) - {1}  # 1: any error, said once for all
    assert not undocumented, f"{cmd.name}: exit status {sorted(undocumented)} is not in EXIT_CODES"
