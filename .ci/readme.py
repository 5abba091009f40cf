"""Prints one of the README's two commands for a fresh machine, as written there, so CI runs exactly what a new user
types: `python .ci/readme.py tests` (the test command) or `python .ci/readme.py quickstart` (the quick start)."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# Each command is the first line of the first bash block after the paragraph that introduces it.
INTRO = {"quickstart": "The quick start (", "tests": "The tests ("}


def command(which: str, text: str = None) -> str:
    text = README.read_text() if text is None else text
    start = text.find(INTRO[which])
    if start < 0:
        raise SystemExit(f"README.md has no paragraph starting {INTRO[which]!r}: where is the {which} command?")
    block = re.search(r"```bash\n(.+?)\n", text[start:])
    if not block:
        raise SystemExit(f"README.md: no bash block after {INTRO[which]!r}")
    return block.group(1).strip()


if __name__ == "__main__":
    print(command(sys.argv[1]))
