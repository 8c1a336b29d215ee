"""The ``pimem`` command line."""

from __future__ import annotations

import os

import typer
from rich.console import Console

from pyworker import schema

app = typer.Typer(help="Long-term conversation memory for chat bots, inside PostgreSQL.",
                  no_args_is_help=True)
console = Console()

DSN_HELP = "libpq connection string or URI of the memory database (or PIMEM_DSN)."


def _dsn(dsn: str | None) -> str:
    value = dsn or os.environ.get("PIMEM_DSN")
    if not value:
        raise typer.BadParameter("give --dsn or set PIMEM_DSN")
    return value


@app.command()
def migrate(dsn: str = typer.Option(None, "--dsn", help=DSN_HELP)) -> None:
    """Bring a database to the current schema (idempotent; uses the yoyo migrations)."""
    applied = schema.migrate(_dsn(dsn))
    if applied:
        console.print(f"applied {len(applied)} migration(s): {', '.join(applied)}")
    else:
        console.print("already up to date")


@app.command("schema-bundle")
def schema_bundle() -> None:
    """Regenerate the unreleased first migration from sql/ (developers only)."""
    path = schema.write_initial_migration()
    console.print(f"wrote {path}")


if __name__ == "__main__":
    app()
