"""The help page of a command that takes no config (rlhpc-status, rlhpc-plots, rlhpc-sandbox): its docstring, its
arguments and its exit codes at a fixed width, the same on every terminal and in docs/commands.md (rlhpc/commands.py
makes the pages of every command from the same pieces)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Dict

WIDTH = 120  # of --help pages and of docs/commands.md's prose
UNLISTED = "An error not listed here ends with its traceback and exit code 1."


def exit_codes_text(codes: Dict[int, str]) -> str:
    lines = ["exit codes:"]
    for code, meaning in codes.items():
        lines.append(textwrap.fill(meaning, WIDTH, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7))
    return "\n".join(lines + [textwrap.fill(UNLISTED, WIDTH, initial_indent="  ", subsequent_indent="  ")])


def argparser(prog: str, doc: str, codes: Dict[int, str]) -> argparse.ArgumentParser:
    """The argument parser of a command that takes no config: its `--help` is the module's docstring, the arguments and
    the exit codes (at a fixed width: the same page on every terminal and in docs/commands.md)."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, epilog=exit_codes_text(codes),
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=WIDTH, max_help_position=32))
