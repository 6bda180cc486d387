"""How both command lines end on a user's mistake (a wrong path, a bad option, a corrupt engine, an over-long
prompt): one line `error: ...` on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click


@contextmanager
def exit_on(*errors: type[BaseException]) -> Iterator[None]:
    try:
        yield
    except errors as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
