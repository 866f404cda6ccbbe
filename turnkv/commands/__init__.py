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
