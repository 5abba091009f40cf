"""The folders rlhpc ships beside its code: `conf/` (Hydra configs), `envs/` (environments), `sbatch/` (job templates).

In the repository they are top-level folders, next to the package; a clone or an editable install (`pip install -e .`)
uses them where they are, so an edit shows at once. A wheel (`pip wheel .`, `python -m build`) carries copies inside
the package, as `rlhpc/data/<folder>` (setup.cfg maps them there), and an installed wheel uses those. The installed
copy wins when both exist: a wheel installed into site-packages must never pick up an unrelated `conf/` lying beside it.

    python -m rlhpc.config.shipped             # where each folder is found here
    python -m rlhpc.config.shipped sbatch      # one folder's path:
    cp "$(python -m rlhpc.config.shipped sbatch)/rlhpc.sbatch" .

Your own configs and environments go in folders of your own (docs/quickstart.md, "Your own configs and
environments"), never into these.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # rlhpc/
FOLDERS = ("conf", "envs", "sbatch")


def folder(name: str) -> Path:
    """The shipped folder `name` (one of FOLDERS): the installed copy inside the package, else the repository's."""
    if name not in FOLDERS:
        raise ValueError(f"rlhpc ships no folder {name!r} (only {', '.join(FOLDERS)})")
    installed = PACKAGE / "data" / name
    return installed if installed.is_dir() else PACKAGE.parent / name


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        try:
            print(folder(args[0]))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    for name in FOLDERS:
        print(f"{name}: {folder(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
