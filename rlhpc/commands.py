"""The reference of every command: what it does, its config groups, the keys it reads (type, default, meaning) and its
exit codes, made from the typed config and the entry points themselves, so that there is no second list to keep.

    python -m rlhpc.commands                              # the reference as Markdown
    python -m rlhpc.commands --write docs/commands.md     # what tests/test_commands.py compares docs/commands.md with

A key's meaning is the comment right above its field in the dataclass that declares it (rlhpc/config/schema.py;
rlhpc/eval.py for the eval command's own keys); a line `---- ... ----` there heads the keys below it instead. A section's meaning is
its dataclass's docstring, else the comment above its field. A command's description is its module's docstring, its
exit codes the module's EXIT_CODES. `--help` of every entry point prints `page(name)`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import MISSING, OmegaConf

from rlhpc.config.commandline import UNLISTED, WIDTH, exit_codes_text
from rlhpc.config.schema import CONF_DIR, Config


@dataclass(frozen=True)
class Command:
    name: str
    script: str  # the console script that runs it (setup.cfg)
    entry: str  # "module:function" the script calls
    keys: Tuple[str, ...] | str = ()  # the config keys it reads, by prefix ("": all), or "module:NAME" of such a tuple;
    #                                   () for a command that takes no config (argparse)
    words: str = ""  # what follows the script on every command line of this command
    described_in: str = ""  # the module of its docstring and EXIT_CODES, when not the entry's
    schema: str = "rlhpc.config.schema:Config"
    args: str = "[group=option ...] [key=value ...]"
    presets: bool = True  # takes whole experiments (+exp=<name>)

    @property
    def module(self):
        return importlib.import_module(self.described_in or self.entry_module)

    @property
    def entry_module(self) -> str:
        return self.entry.partition(":")[0]

    @property
    def typed(self) -> str:
        """How a user types it: the script and the words that make it this command."""
        return f"{self.script} {self.words}".strip()

    @property
    def hydra(self) -> bool:
        return bool(self.keys)

    def key_prefixes(self) -> Tuple[str, ...]:
        return _attr(self.keys) if isinstance(self.keys, str) else self.keys


COMMANDS = (
    Command("launch", "rlhpc-launch", "rlhpc.launch:main", keys=("",)),
    Command("attach", "rlhpc-launch", "rlhpc.launch:main", keys="rlhpc.cluster.attach:ATTACH_KEYS",
            words="+attach=inference", described_in="rlhpc.cluster.attach", presets=False,
            args="run_dir=<run> +attach=inference [inference.*|launcher.*|cluster.*=value ...]"),
    Command("sft", "rlhpc-sft", "rlhpc.sft:main",
            keys=("run_dir", "overwrite", "resume", "seed", "model", "env", "sft", "eval.num_tasks",
                  "trainer.logprob_chunk_tokens")),
    Command("serve", "rlhpc-serve", "rlhpc.serve:main", keys=("run_dir", "seed", "model", "inference")),
    Command("eval", "rlhpc-eval", "rlhpc.eval:main", keys=("seed", "model", "env", "inference", "eval"),
            schema="rlhpc.eval:EvalCommandConfig"),
    Command("status", "rlhpc-status", "rlhpc.status:main"),
    Command("plots", "rlhpc-plots", "rlhpc.plots:main"),
    Command("sandbox check", "rlhpc-sandbox", "rlhpc.env.sandbox:main", words="check"),
)


def command(name: str) -> Command:
    return next(c for c in COMMANDS if c.name == name)


def _attr(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ---- keys, from the typed config ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    path: str  # "trainer.optim.lr"
    type: str
    default: Any
    meaning: str
    heading: str = ""  # a `---- heading ----` comment above it: it starts a group of keys within its section


@dataclass
class Section:
    path: str  # "" for the top-level keys
    meaning: str
    keys: List[Key] = field(default_factory=list)


HEADING = re.compile(r"-{3,}\s*(.*?)\s*-{3,}")


@functools.lru_cache(maxsize=None)
def _notes(cls: type) -> Tuple[str, Dict[str, Tuple[str, str]]]:
    """(docstring, {field: (meaning, heading)}) of one class, from its source: a field's meaning is the block of
    comment lines right above it; a `---- heading ----` line ends that block."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT and t.line.lstrip().startswith("#")}
    node = ast.parse(source).body[0]
    fields = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            n, lines = stmt.lineno - 1, []
            while n in comments and not HEADING.fullmatch(comments[n]):
                lines.insert(0, comments[n])
                n -= 1
            heading = HEADING.fullmatch(comments.get(n, ""))
            fields[stmt.target.id] = (" ".join(lines), heading.group(1) if heading else "")
    return " ".join((ast.get_docstring(node) or "").split()), fields


def _meanings(cls: type) -> Dict[str, Tuple[str, str]]:
    """The fields' (meaning, heading) of a dataclass, its dataclass bases' included (rlhpc.eval's keys extend the
    trainer's)."""
    out: Dict[str, Tuple[str, str]] = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            out.update(_notes(c)[1])
    return out


def _type(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    optional = re.fullmatch(r"Optional\[(.+)\]", text)
    if optional:
        return f"{_type(optional.group(1))} or null"
    return {"Dict": "dict", "List": "list"}.get(text.partition("[")[0], text)


def sections(schema: str = "rlhpc.config.schema:Config") -> List[Section]:
    """Every key of a schema with its type, default (the dataclasses' own, nested sections' included) and meaning, by
    section: the top-level keys first, then each section before the sections inside it."""
    out: List[Section] = []

    def walk(obj: Any, path: str, meaning: str) -> None:
        section = Section(path, meaning)
        out.append(section)
        notes, inner = _meanings(type(obj)), []
        for f in dataclasses.fields(obj):
            value, (text, heading) = getattr(obj, f.name), notes[f.name]
            key = f"{path}.{f.name}" if path else f.name
            if dataclasses.is_dataclass(value):
                inner.append((value, key, _notes(type(value))[0] or text))
            else:
                section.keys.append(Key(key, _type(f.type), value, text, heading))
        for args in inner:
            walk(*args)

    root = _attr(schema)
    walk(root(), "", "")
    return out


def keys(schema: str = "rlhpc.config.schema:Config") -> List[Key]:
    return [k for s in sections(schema) for k in s.keys]


def _reads(prefixes: Sequence[str], path: str) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def command_sections(cmd: Command) -> List[Section]:
    """The sections of the command's schema, holding only the keys it reads."""
    prefixes = cmd.key_prefixes()
    picked = [Section(s.path, s.meaning, [k for k in s.keys if _reads(prefixes, k.path)]) for s in sections(cmd.schema)]
    return [s for s in picked if s.keys]


def default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == MISSING:
        return "(conf/config.yaml)"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return repr(value)


# ---- config groups, from conf/ --------------------------------------------------------------------------------------


def _defaults() -> Dict[str, Optional[str]]:
    """The option conf/config.yaml's defaults list picks for a group (None: none)."""
    return {group: option for entry in OmegaConf.load(CONF_DIR / "config.yaml").defaults if not isinstance(entry, str)
            for group, option in OmegaConf.to_container(entry).items()}


def groups() -> Dict[str, List[str]]:
    """conf/'s groups and their options, the default option first."""
    defaults = _defaults()
    out = {}
    for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        out[folder.name] = sorted(options, key=lambda o: o != defaults.get(folder.name))
    return out


def command_groups(cmd: Command) -> Dict[str, List[str]]:
    prefixes = cmd.key_prefixes()
    return {g: options for g, options in groups().items()
            if (g == "exp" and cmd.presets) or (g != "exp" and _reads(prefixes, g))}


def _choice(group: str) -> Tuple[str, str]:
    """How a group's option is chosen on the command line, and the default (conf/config.yaml's defaults list)."""
    if group == "exp":  # whole experiments, in no defaults list: added
        return "+exp=<name>", "none"
    return f"{group}=<name>", _defaults().get(group) or "none"


# ---- exit codes and argparse commands -------------------------------------------------------------------------------


def exit_on_help(name: str, argv: Sequence[str]) -> None:
    """For a Hydra command: `--help` or `-h` prints its page and exits 0 (Hydra's own help is `--hydra-help`)."""
    if "--help" in argv or "-h" in argv:
        print(page(name))
        sys.exit(0)


def hydra_command(name: str, run: Callable[[Any], None], schema: Optional[type] = None) -> None:
    """The start the Hydra commands (launch, sft, serve, eval) share: `--help` prints the command's page; the
    algorithms register their config checks; the typed schema (`schema`, a command's own, or the run's Config) goes
    into Hydra's ConfigStore; a command line that does not compose ends in one line naming the key, with exit code 2;
    then Hydra composes the config from conf/ and the command line and calls `run` with it."""
    import hydra
    from hydra.core.config_store import ConfigStore

    from rlhpc import algo  # noqa: F401  (registers the algorithms' config checks)
    from rlhpc.config.errors import exit_on_composition_error

    argv = sys.argv[1:]
    exit_on_help(name, argv)
    node = schema or Config
    ConfigStore.instance().store(name="rlhpc_schema", node=node)
    exit_on_composition_error(argv, typed=lambda dcfg: OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(node),
                                                                                           dcfg)))
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run)()


# ---- the --help page ------------------------------------------------------------------------------------------------


def _doc(cmd: Command) -> str:
    return (cmd.module.__doc__ or "").strip()


def _summary(cmd: Command) -> str:
    """The docstring's first paragraph, in one line."""
    return " ".join(_doc(cmd).split("\n\n")[0].split())


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent)


def page(name: str) -> str:
    """What `--help` of the command prints."""
    cmd = command(name)
    if not cmd.hydra:
        return cmd.module.parser().format_help().rstrip()
    lines = [f"usage: {cmd.script} {cmd.args}", f"       (or python -m {cmd.entry_module} ...)", "", _doc(cmd), "",
             "config groups (conf/<group>/<name>.yaml):"]
    for g, options in command_groups(cmd).items():
        how, default = _choice(g)
        lines.append(textwrap.fill(" ".join(options), WIDTH, initial_indent=f"  {f'{how} (default: {default})':<40} ",
                                   subsequent_indent=" " * 43))
    changed_by = "a group's option" + (" or +exp" if cmd.presets else "")
    lines += ["", f"keys (key=value; the typed config's defaults, which {changed_by} may change):"]
    for s in command_sections(cmd):
        lines += ["", textwrap.fill(f"{s.path}: {s.meaning}" if s.path else "top level", WIDTH, subsequent_indent="  ")]
        for k in s.keys:
            if k.heading:
                lines.append(f"  -- {k.heading} --")
            lines += [f"  {k.path}: {k.type} = {default_text(k.default)}", _wrap(k.meaning, " " * 6)]
    lines += ["", exit_codes_text(cmd.module.EXIT_CODES), "",
              "Hydra's own flags (-m for a sweep, --cfg job to print the composed config, ...): --hydra-help."]
    return "\n".join(lines)


# ---- docs/commands.md -----------------------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return "#" + re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """Markdown showing `text` as written: outside code (`spans`, paragraphs indented 4 spaces) `<` and `*` are
    escaped, where Markdown would read a tag (`<rank>`) or emphasis (`inference.*, cluster.*`)."""
    out = []
    for para in text.split("\n\n"):
        if all(line.startswith("    ") for line in para.splitlines()):
            out.append(para)
            continue
        parts = para.split("`")
        out.append("`".join(p if i % 2 else p.replace("<", "&lt;").replace("*", "\\*") for i, p in enumerate(parts)))
    return "\n\n".join(out)


def _cell(text: str) -> str:
    return _prose(text).replace("|", "\\|")


def _key_table(ks: Sequence[Key]) -> Iterator[str]:
    yield "| key | type | default | meaning |"
    yield "|---|---|---|---|"
    for k in ks:
        if k.heading:
            yield f"| *{_cell(k.heading)}* | | | |"
        default = _cell(default_text(k.default)) if k.default == MISSING else f"`{_cell(default_text(k.default))}`"
        yield f"| `{k.path}` | {_cell(k.type)} | {default} | {_cell(k.meaning)} |"


def _section_heading(s: Section) -> str:
    return f"Keys: {s.path or 'top level'}"


def markdown() -> str:
    """docs/commands.md."""
    out = [
        "# Commands",
        "",
        "<!-- Made by `python -m rlhpc.commands --write docs/commands.md` from rlhpc/config/schema.py and the entry "
        "points; tests/test_commands.py fails when this page differs: change those, then run it again. -->",
        "",
        "Every command of rlhpc: what it does, the config groups and keys it reads (type, default, meaning) and its "
        "exit codes. `--help` (or `-h`) of each prints the same, from the same source: the typed config "
        "(rlhpc/config/schema.py) and the commands' own modules. The commands that take a config compose it with Hydra "
        "from `conf/` and the command line (`group=name`, `key=value`, `+exp=<name>`); `--hydra-help` shows Hydra's "
        "own flags (`-m` for a sweep, `--cfg job` to print the composed config). " + UNLISTED,
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for cmd in COMMANDS:
        out.append(f"| [`{cmd.typed}`]({_anchor(cmd.name)}) | {_cell(_summary(cmd))} |")
    base = {k.path for k in keys()}
    for cmd in COMMANDS:
        also = f"python -m {cmd.entry_module} {cmd.words}".strip()
        out += ["", f"## {cmd.name}", "", f"`{cmd.typed}` (or `{also}`)", "", _prose(_doc(cmd)), ""]
        if cmd.hydra:
            out.append(f"Usage: `{cmd.script} {cmd.args}`")
            out.append("")
            out.append("Config groups: " + ", ".join(f"`{g}`" for g in command_groups(cmd))
                       + " ([options](#config-groups)).")
            out.append("")
            picked = command_sections(cmd)
            if cmd.key_prefixes() == ("",):
                out.append("Keys: [every key](#keys).")
            else:
                refs = [f"[`{p}`]({_anchor(_section_heading(_section_of(p, picked)))})" for p in cmd.key_prefixes()]
                out.append("Keys: " + ", ".join(refs) + ".")
            own = [k for s in picked for k in s.keys if k.path not in base]
            if own:
                out += ["", "Its own keys (besides those of a training run's config):", "", *_key_table(own)]
        else:
            parser = cmd.module.parser()
            parser.description = parser.epilog = None
            out += ["```", parser.format_help().rstrip(), "```"]
        out += ["", "| exit code | meaning |", "|---|---|"]
        out += [f"| {code} | {_cell(meaning)} |" for code, meaning in cmd.module.EXIT_CODES.items()]
    out += ["", "## Config groups", "", "Each is a folder of `conf/`; `group=name` picks `conf/<group>/<name>.yaml`, "
            "which sets some of the keys below.", "", "| group | how | default | options |", "|---|---|---|---|"]
    for g, options in groups().items():
        how, default = _choice(g)
        out.append(f"| `{g}` | `{how}` | {default} | {', '.join(options)} |")
    out += ["", "## Keys", "", "Every key of the typed config (rlhpc/config/schema.py) with the default of its "
            "dataclass; a group's option (`model=...`, `env=...`) or `+exp=...` may set another.", ""]
    for s in sections():
        out += [f"### {_section_heading(s)}", ""]
        if s.meaning:
            out += [_prose(s.meaning), ""]
        out += [*_key_table(s.keys), ""]
    return "\n".join(_wrapped(out)).rstrip() + "\n"


def _wrapped(lines: Sequence[str]) -> List[str]:
    """Prose lines of the page at 120 characters (tests/test_docs.py); tables and code blocks as they are."""
    out, code = [], False
    for block in lines:
        for line in block.split("\n"):
            code ^= line.startswith("```")
            if code or line.startswith(("|", "```")) or len(line) <= 120:
                out.append(line)
                continue
            lead = line[:len(line) - len(line.lstrip())]
            bullet = lead + ("- " if line.lstrip().startswith("- ") else "")
            out += textwrap.wrap(line, 120, subsequent_indent=" " * len(bullet), break_long_words=False,
                                 break_on_hyphens=False)
    return out


def _section_of(prefix: str, picked: Sequence[Section]) -> Section:
    """The section that `prefix` names, or the one holding the key it names."""
    return next(s for s in picked if s.path == prefix or any(k.path == prefix for k in s.keys))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhpc.commands", description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="FILE", help="write the Markdown reference to FILE (default: print it)")
    args = ap.parse_args(argv)
    text = markdown()
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
