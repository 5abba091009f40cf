"""The documentation holds together: every page under docs/ is in the README's list, prose is wrapped for reading,
every relative link reaches a file (and a heading, when it names one) that exists, and the preset table of
docs/scaling.md shows what the dry run prints. Only files are read and configs composed; no model is built and no
process started.

Tables and code blocks may keep longer lines: a table row cannot be broken, and a code block quotes commands and
program output as they are."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
WIDTH = 120

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
# [text](target) and ![alt](target); the text may span lines, the target has no blanks
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def classify(text: str):
    """(line number, line, kind) for each line; kind is "code" inside a fenced block (its fences included), "table" for
    a table row, else "prose". A fence closes on the same character, at least as long, with no info string."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = (len(m.group(1)), m.group(2))
            yield n, line, "code"
        elif fence is not None:
            if (m and m.group(2)[0] == fence[1][0] and len(m.group(2)) >= len(fence[1])
                    and not line[m.end():].strip() and len(m.group(1)) <= fence[0] + 3):
                fence = None
            yield n, line, "code"
        else:
            yield n, line, "table" if line.lstrip().startswith("|") else "prose"


def prose(text: str) -> str:
    """The page without its code blocks and inline code (links there are examples, not links)."""
    kept = "\n".join(line if kind != "code" else "" for _, line, kind in classify(text))
    return INLINE_CODE.sub("", kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, blanks to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for _, line, kind in classify(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if kind == "prose" and m:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path):
    for m in LINK.finditer(prose(path.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        yield target


def test_every_page_under_docs_is_in_the_readme_list():
    readme = {(ROOT / t.split("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [rel(p) for p in DOCS if p.resolve() not in readme]
    assert not missing, f"README.md's Documentation list lacks {missing}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_prose_lines_are_at_most_120_characters(page):
    long = [f"{rel(page)}:{n} ({len(line)} characters)" for n, line, kind in classify(page.read_text())
            if kind == "prose" and len(line) > WIDTH]
    assert not long, "wrap these at 120 characters (tables and code blocks may be longer):\n" + "\n".join(long)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_reach_a_file_and_its_heading(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(page)}:\n" + "\n".join(broken)


def test_the_checks_see_what_they_should():
    # A fence inside a code block (a quoted answer with its own ```python block) does not end the block, a table row
    # is a table, and a link inside inline code is an example, not a link.
    text = "```\nanswer:\n       ```python\n       x = 1\n       ```\n```\n| a | b |\nsee [x](x.md) and `[y](y.md)`\n"
    kinds = [kind for _, _, kind in classify(text)]
    assert kinds == ["code"] * 6 + ["table", "prose", "prose"]
    assert [m.group(1) for m in LINK.finditer(prose(text))] == ["x.md"]
    assert slug("`python -m rlhpc.status RUN_DIR`") == "python--m-rlhpcstatus-run_dir"
    assert slug("Packing: a group's prompt once (`rlhpc/train/batching.py`)") == \
        "packing-a-groups-prompt-once-rlhpctrainbatchingpy"


def test_the_preset_table_of_scaling_md_shows_what_the_dry_run_prints(monkeypatch):
    """Each row's memory per trainer rank, FP8 weights per inference GPU and KV room are the plan's
    (rlhpc/cluster/memory.py, for a checkpoint only the cluster can read, as on a login node)."""
    from hydra import compose, initialize_config_dir

    from rlhpc.cluster import memory
    from rlhpc.config import schema as config_mod

    monkeypatch.setenv("RLHPC_MODEL_PATH", "/nonexistent/checkpoint-on-the-cluster")
    rows = {}
    for _, line, kind in classify((ROOT / "docs" / "scaling.md").read_text()):
        m = re.match(r"^\| `(\w+)` \|", line)
        if kind == "table" and m:
            rows[m.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    assert len(rows) >= 8, "the preset table of docs/scaling.md was not found"
    config_mod.register()
    wrong = []
    for exp, cells in rows.items():
        with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
            cfg = config_mod.to_typed(compose(config_name="config",
                                              overrides=[f"+exp={exp}", "launcher=slurm", "dry_run=true"]))
        plan = "\n".join(memory.plan(cfg).lines)
        total = re.search(r"^ +total +([\d.,]+) GiB +of (\d+) GiB", plan, re.M)
        weights = re.search(r"^ +weights +([\d.,]+) GiB", plan, re.M)
        room = re.search(r"KV room for (\d+) sequence", plan)
        printed = (f"{total[1]} of {total[2]} GiB", f"{weights[1]} GiB", f"KV for {room[1]} x")
        shown = (cells[3], cells[5].split(",")[0].replace(" weights", ""), cells[5])
        if printed[0] != shown[0] or printed[1] != shown[1] or printed[2] not in shown[2]:
            wrong.append(f"{exp}: the table shows {cells[3]!r}, {cells[5]!r}; the dry run prints {printed}")
    assert not wrong, "docs/scaling.md, Presets:\n" + "\n".join(wrong)
