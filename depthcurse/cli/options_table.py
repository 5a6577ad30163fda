"""docs/commands.md's table of every option of every command, made from the commands themselves.

A name more than one command takes says the one idea `vocabulary.VOCABULARY` gives it; a name one
command alone takes says the first sentence of that command's help for it. `tests/test_cli.py` checks
the table in docs/commands.md against `markdown()`, so an option added, renamed or moved to another
command is in the docs or the suite fails. To write it again in docs/commands.md:

    .venv/bin/python -m depthcurse.cli.options_table docs/commands.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from depthcurse.cli import app
from depthcurse.cli.vocabulary import VOCABULARY

BEGIN = "<!-- every option: made by python -m depthcurse.cli.options_table -->"
END = "<!-- every option: end -->"


ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf")  # a full stop after these ends no sentence


def _first_sentence(text: str) -> str:
    text = " ".join((text or "").split())
    for cut in re.finditer(r"(?<=[a-z0-9)\]`'])\. ", text):
        if not text[: cut.start()].endswith(ABBREVIATIONS):
            text = text[: cut.start() + 1]
            break
    return text.replace("|", "\\|")


def rows() -> list[tuple[str, list[str], str]]:
    """(option, the commands that take it, what it is), every visible option of every command, by name."""
    command = typer.main.get_command(app)
    taken: dict[str, list[str]] = {}
    helps: dict[str, str] = {}
    for name, sub in sorted(command.commands.items()):
        for param in sub.params:
            if param.param_type_name == "option" and not param.hidden:
                taken.setdefault(param.opts[0], []).append(name)
                helps.setdefault(param.opts[0], param.help or "")
    return [(option, commands, VOCABULARY[option][0] if option in VOCABULARY else _first_sentence(helps[option]))
            for option, commands in sorted(taken.items())]


def markdown() -> str:
    lines = [BEGIN, "", "| option | taken by | what it is |", "|---|---|---|"]
    lines += [f"| `{option}` | {', '.join(commands)} | {what} |" for option, commands, what in rows()]
    return "\n".join([*lines, "", END])


def write(path: Path) -> None:
    """The table in `path` between its two markers made again."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + markdown() + text[end:])


if __name__ == "__main__":
    if len(sys.argv) > 1:
        write(Path(sys.argv[1]))
    else:
        print(markdown())
