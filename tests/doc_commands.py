"""The shell commands a user meets: every command line of the shell blocks of README.md and docs/*.md, and
every example line of every `loramux ... --help` epilog, as the text a user would type.

- A ```bash / ```sh / ```shell block: each line is a command line (``\\``-continuations joined, ``# ...``
  comments dropped); ``a && b`` and ``a; b`` are two commands. A ```console block: only the ``$ `` lines.
- An untagged block with a ``loramux`` line is a synopsis (metavariables, ``[optional]`` parts): it does not
  run; tests/test_docs.py checks its commands and options against the parser. An untagged block whose
  ``loramux`` lines hold no ``[`` is a command block that lost its tag, and is reported as such.
- An epilog: the lines that begin with ``loramux`` or ``serve run`` (after an ``example:``/``then:`` label).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
SHELL_LANGS = ("bash", "sh", "shell")
COMMAND_START = re.compile(r"^(loramux|serve run)\s")


@dataclass(frozen=True)
class Script:
    """Commands meant to run one after another in one directory (a doc block, or one command's examples)."""

    where: str  # README.md:L13, or `loramux serve --help`
    commands: tuple[str, ...]


def fenced_blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, language, lines) of each fenced block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m["fence"]
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        out.append((start + 1, m["lang"].lower(), lines[start + 1:i]))
        i += 1
    return out


def _strip_comment(line: str) -> str:
    """A line without its trailing ``# comment`` (a ``#`` after white space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def command_lines(lines: list[str], *, prompt: bool = False) -> list[str]:
    """The commands of shell lines: continuations joined, comments dropped, `&&`/`;` split. With `prompt`,
    only lines starting with ``$ `` are commands (a console transcript)."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if prompt:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = _strip_comment(line)
        for part in re.split(r"\s*(?:&&|;)\s*", line):
            part = " ".join(part.split())
            if part:
                out.append(part)
    return out


def doc_scripts() -> list[Script]:
    """One Script per shell block of README.md and docs/*.md."""
    out = []
    for doc in DOCS:
        rel = doc.relative_to(ROOT)
        for line, lang, lines in fenced_blocks(doc):
            if lang in SHELL_LANGS or lang == "console":
                cmds = command_lines(lines, prompt=lang == "console")
                if cmds:
                    out.append(Script(f"{rel}:L{line}", tuple(cmds)))
    return out


def untagged_command_blocks() -> list[str]:
    """Untagged blocks that hold `loramux` commands but no synopsis brackets: they should be ```bash."""
    out = []
    for doc in DOCS:
        for line, lang, lines in fenced_blocks(doc):
            cmd = [ln for ln in lines if re.match(r"^\s*(\$ )?loramux\s", ln)]
            if not lang and cmd and not any("[" in ln for ln in cmd):
                out.append(f"{doc.relative_to(ROOT)}:L{line}")
    return out


def _subparsers(parser: argparse.ArgumentParser, prog: str) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(prog, parser)]
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _subparsers(sub, f"{prog} {name}")
    return out


def epilog_scripts() -> list[Script]:
    """One Script per `--help` whose epilog shows example commands."""
    from loramux.cli import build_parser

    out = []
    for prog, parser in _subparsers(build_parser(), "loramux"):
        text = parser.epilog or ""
        lines = []
        for raw in re.sub(r"\\\n\s*", " ", text).splitlines():
            raw = re.sub(r"^\s*(examples?|then):\s*", "", raw).strip()
            if COMMAND_START.match(raw):
                lines.append(raw)
        cmds = command_lines(lines)
        if cmds:
            out.append(Script(f"`{prog} --help`", tuple(dict.fromkeys(cmds))))
    return out


def all_scripts() -> list[Script]:
    return doc_scripts() + epilog_scripts()
