"""The ``turnkv`` sub-commands, and what they share: one flag name per concept, the old names kept as hidden
aliases (``renamed``)."""

from __future__ import annotations

from typing import Any

import typer

#: Where a value counts as given (not a default).
_GIVEN = ("COMMANDLINE", "ENVIRONMENT")


def renamed(ctx: typer.Context, param: str, old_param: str) -> Any:
    """The value of option ``param``, which also answers to its former name: a hidden option whose parameter is
    ``old_param``. The former name wins over ``param``'s default; both given with different values is refused."""
    old = ctx.params.get(old_param)
    value = ctx.params.get(param)
    if old is None:
        return value
    source = ctx.get_parameter_source(param)
    if source is not None and source.name in _GIVEN and value != old:
        names = {p.name: p.opts[0] for p in ctx.command.params}
        raise typer.BadParameter(f"{names.get(old_param, old_param)} is the former name of "
                                 f"{names.get(param, param)}: give one of them")
    return old


def unbroken(table: Any) -> Any:
    """A rich ``Table`` whose columns are never narrower than their longest word (header or cell): rich's default
    cut names at 80 columns ("prefi…", "peer+…"); now a header wraps by word and a cell never loses its end."""
    for column in table.columns:
        words = [word for text in (str(column.header), *map(str, column.cells)) for word in text.split()]
        column.min_width = max(map(len, words), default=1)
    return table


def show_table(console: Any, table: Any) -> None:
    """Print ``table`` where it fits the console without cutting a word, else one record per row (``header:
    value`` lines under the row's first cell): a table wider than the terminal was cut at its right edge."""
    unbroken(table)
    if table.__rich_measure__(console, console.options).minimum <= console.width:
        console.print(table)
        return
    headers = [str(c.header) for c in table.columns]
    if table.title:
        console.print(table.title, style="bold", markup=False, highlight=False)
    for row in zip(*(list(map(str, c.cells)) for c in table.columns), strict=True):
        console.print(row[0], markup=False, highlight=False)
        for header, value in zip(headers[1:], row[1:], strict=True):
            console.print(f"  {header}: {value}", markup=False, highlight=False)
    if table.caption:
        console.print(table.caption, markup=False, highlight=False)
