"""The documentation holds together: every page under docs/ is in the README's list, prose is wrapped for reading,
every relative link reaches a file (and a heading, when it names one) that exists, the preset table of
docs/scaling.md shows what the dry run prints, every recipe of the README's "Next steps" passes the checks a launch
makes before it starts, and each figure the README quotes from another page is the one that page measured. Only
files are read and configs composed; no model is built and no process started.

Tables and code blocks may keep longer lines: a table row cannot be broken, and a code block quotes commands and
program output as they are."""

import importlib
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


# ---- the README's recipes ----------------------------------------------------------------------------------------

RECIPE_TABLE = "## Next steps on a laptop"


def readme_recipes():
    """The commands of the README's recipe table (its rows whose first cell is one `python -m rlhpc.<command> ...`),
    with the shell variables the section's bash block sets filled in."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(RECIPE_TABLE):]
    section = section[:section.index("\n## ", 1)]
    variables = dict(re.findall(r'^(\w+)="([^"]*)"$', section, re.M))
    recipes = []
    for _, line, kind in classify(section):
        m = re.match(r"^\| `(python -m rlhpc\.(\w+)[^`]*)` \|", line)
        if kind == "table" and m:
            command = re.sub(r"\$(\w+)", lambda v: variables[v.group(1)], m.group(1))
            recipes.append(pytest.param(m.group(2), command.split()[3:], id=m.group(1)))
    return recipes


def test_the_recipe_table_is_found():
    commands = {r.values[0] for r in readme_recipes()}
    assert {"launch", "sft", "eval", "serve", "status"} <= commands, commands


@pytest.mark.parametrize("command, args", [r for r in readme_recipes()
                                           if r.values[0] != "status" and r.values[1] != ["--help"]])
def test_every_readme_recipe_composes_and_passes_the_checks_before_launch(command, args):
    """Each recipe's keys exist, its values have the right types and pass the config checks, and the environment's
    turns fit the model it names (what the launcher refuses before anything starts). Files are not looked at: the
    recipes' model folders and run directories exist only once the recipes above them ran."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from rlhpc.config import schema as config_mod
    from rlhpc.eval import EvalCommandConfig
    from rlhpc.preflight import checks

    importlib.import_module("rlhpc.algo")  # registers the algorithms' config checks, as every command does
    overrides = [a.replace("<", "").replace(">", "") for a in args]  # runs/reverse_text/<time>: a folder name
    schema = EvalCommandConfig if command == "eval" else config_mod.Config
    ConfigStore.instance().store(name="rlhpc_schema", node=schema)  # as the command's start does (rlhpc.commands)
    try:
        with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
            dcfg = compose(config_name="config", overrides=overrides)
    finally:
        config_mod.register()  # the run's schema again, for the tests after this one
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dcfg))
    config_mod.validate(cfg)
    checks.check_loss(cfg)
    if not cfg.model.path:
        checks.check_context(cfg)


# ---- figures the README quotes from the pages that measured them -------------------------------------------------


def _minutes(text: str) -> float:
    """`2 min 51 s` -> 2.85."""
    m = re.match(r"(\d+) min (\d+) s", text)
    return int(m[1]) + int(m[2]) / 60


def _tier_seconds(tier: str) -> int:
    """The seconds of a tier's row in docs/testing.md's table (the first `(N s` of the row)."""
    row = re.search(rf"^\| {tier} \|.*?\((\d+) s", (ROOT / "docs" / "testing.md").read_text(), re.M)
    return int(row[1])


# (what, the README's figure, the page that measured it, the figure there, how the page's figure reads in the README)
QUOTED = [
    ("the quick start's time", r"no download; ~(\d+) minutes on 2 cores", "quickstart.md",
     r"^\| wall time \| (\d+ min \d+ s)", lambda v: str(round(_minutes(v)))),
    ("the default tier's time", r"slow end-to-end ones \(about (\d+) minutes on 2 cores\)", "testing.md",
     r"^\| default \|.*?\| ~(\d+) min \(", str),
    ("the default and slow tiers' time", r"`python -m pytest --slow` \(about (\d+) minutes on 2\s+cores", "testing.md",
     r"^\| slow \|.*?\((\d+) s\)", lambda v: str(10 * round((int(v) + _tier_seconds("default")) / 600))),
    ("the quick start's final reward", r"the quick start's whole run of 300 steps reaches ~(0\.\d\d)", "quickstart.md",
     r"^\| after RL \(300 steps.*?\| (0\.\d\d)\d", str),
    ("tool_text's time", r"`python -m rlhpc.launch \+exp=tool_text` \| about (\d+) minutes", "environments.md",
     r"the whole command about (\d+) minutes", str),
    ("tool_text's warm start", r"trajectories with a tool call to about (0\.\d+-0\.\d+)", "environments.md",
     r"^\| `python -m rlhpc.launch \+exp=tool_text seed=0`.*?\| (0\.\d+) \(\d+ steps\)(?s:.*)^\| the same command.*?\| "
     r"(0\.\d+) \(\d+ steps\)", lambda *v: "-".join(f"{float(x):.2f}" for x in v)),
    ("tool_text's gain", r"then RL gains (\+0\.\d+ to \+0\.\d+) in 150 steps", "environments.md",
     r"^\| `python -m rlhpc.launch \+exp=tool_text seed=0`(?:[^|]*\|){4}[^|]*\((\+0\.\d+)\)(?s:.*)"
     r"^\| the same command(?:[^|]*\|){4}[^|]*\((\+0\.\d+)\) \|", lambda high, low: f"{low} to {high}"),
    ("the short run of wordle", r"`python -m rlhpc.launch \+exp=reverse_text env=wordle [^`]*` \| ~(\d+) minutes",
     "environments.md",
     r"in ~(\d+) minutes for `wordle`", str),
    ("the short run of math", r"`python -m rlhpc.launch \+exp=reverse_text env=math [^`]*` \| (under a minute)",
     "environments.md", r"finishes in (under a minute) for `math`, `code`", str),
    ("the vLLM run", r"`[^`]*inference.engine=vllm sft.steps=50 trainer.steps=5` \| ~(\d+ s)", "vllm.md",
     r"inference.engine=vllm sft.steps=50 trainer.steps=5`, two\s+workers with a vLLM engine each, ~(\d+ s)\)", str),
    ("the local cluster's start", r"local_slurm.sh up`, (\d+ s) once its packages are installed", "slurm-local.md",
     r"with packages present (\d+ s);", str),
]


@pytest.mark.parametrize("what, in_readme, page, on_page, reads", QUOTED, ids=[q[0] for q in QUOTED])
def test_a_figure_the_readme_quotes_is_the_one_its_page_measured(what, in_readme, page, on_page, reads):
    readme = re.search(in_readme, (ROOT / "README.md").read_text(), re.M)
    measured = re.search(on_page, (ROOT / "docs" / page).read_text(), re.M)
    assert readme, f"README.md no longer gives {what} as the pattern {in_readme!r} expects: update the test"
    assert measured, f"docs/{page} no longer gives {what} as the pattern {on_page!r} expects: update the test"
    assert readme[1] == reads(*measured.groups()), \
        f"{what}: README.md says {readme[1]!r}, docs/{page} measured {measured.group(0)!r}"
