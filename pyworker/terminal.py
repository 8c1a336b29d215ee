"""Tables for the terminal and for pipes: what every ``pimem`` command that prints a table uses.

A table reads at 80 columns: few columns, several facts stacked in one cell, and the columns
that hold ids and names never narrower than their longest line, so an id is never cut (rich
cuts a cell with ``…`` when a table does not fit; here a cell wraps or folds instead). In a pipe
or a file (no terminal, no ``COLUMNS``) lines are as long as the table needs, never cut to 80,
and carry no trailing spaces.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# As wide as any table needs: rich wraps nothing at this width.
UNLIMITED = 100_000


def output_console() -> Console:
    """The console a command prints its tables on: the terminal's width on a terminal (or
    ``COLUMNS`` when set); in a pipe or a file, unlimited, so whole lines reach the log."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=UNLIMITED)


def _plain(cell: str) -> str:
    return Text.from_markup(cell).plain


def fitted_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *,
                 keep: Sequence[int] = (0,), right: Sequence[int] = ()) -> Table:
    """A table of rich-markup cells (a cell may hold several lines: stacked facts). The
    columns in ``keep`` (ids, names) are at least as wide as their longest line; every cell
    folds rather than being cut. ``right`` columns are right-aligned (numbers)."""
    stacked = any("\n" in cell for row in rows for cell in row)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, padding=(0, 1, 0, 0), show_lines=stacked)
    for i, header in enumerate(headers):
        width = None
        if i in keep:
            width = max([len(line) for row in rows for line in _plain(row[i]).splitlines()]
                        + [len(header)])
        table.add_column(header, overflow="fold", min_width=width,
                         justify="right" if i in right else "left")
    for row in rows:
        table.add_row(*row)
    return table


def emit(console: Console, *renderables: Any) -> None:
    """Prints on ``console``; on an unlimited console (a pipe, a file) without the trailing
    spaces rich pads lines with."""
    if console.width < UNLIMITED:
        for renderable in renderables:
            console.print(renderable)
        return
    with console.capture() as captured:
        for renderable in renderables:
            console.print(renderable)
    text = captured.get()
    console.file.write("\n".join(line.rstrip() for line in text.split("\n")))
