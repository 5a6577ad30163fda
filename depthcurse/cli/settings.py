"""`settings`: every search's and recovery method's settings, with their defaults, from the registries."""

from __future__ import annotations

from typing import List, Optional

import typer

from depthcurse.cli.shared import console


def settings(
    names: Optional[List[str]] = typer.Argument(None, help="Searches or methods to list (evo, lora, my_search.py:MySearch, ...); left out: every one, your installed plug-ins included."),
) -> None:
    """Every setting `select --search-args` and `heal --method-args` take: its type, its default and
    what it is, for the built-in searches and methods, installed plug-ins, and any module:Class or
    file.py:Class given.

    Example: depthcurse settings evo laco my_search.py:MySearch"""
    from rich.table import Table

    from depthcurse.listing import settings_rows

    table = Table(title="settings: select --search-args name.key=value; heal --method-args key=value (one method) | name.key=value (several)",
                  title_justify="left")
    for column in ("for", "setting", "type", "default", "what it is (and where its default comes from)"):
        table.add_column(column, overflow="fold")
    for row in settings_rows(names or []):
        table.add_row(row["for"], row["setting"], row["type"], str(row["default"]), row["about"], style="bold" if row["for"] else None)
    console.print(table)
