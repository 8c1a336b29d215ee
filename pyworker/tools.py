"""The two memory tools a bot offers its model, as the database defines them.

``memory.tool_definitions()`` (role ``memory_backend``, sql/56_tools.sql) returns both as
``[{name, description, parameters}]`` function definitions, their parameters a JSON Schema whose
limits are the ones ``memory.query_memories`` / ``memory.manage_memory`` enforce. A backend in any
language reads them there; a Python backend with :meth:`pyworker.client.MemoryClient.tool_definitions`.
:func:`in_shape` puts them in the shape a model API takes: OpenAI's (chat completions and the
many OpenAI-compatible APIs: ``{"type": "function", "function": {name, description,
parameters}}``) or Anthropic's (``{name, description, input_schema}``); the schemas are passed
unchanged. This module also prints them, for a backend that wants them as a file:

    python -m pyworker.tools --dsn "$PIMEM_DSN" --shape openai > tools.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Literal, get_args

import psycopg

from pyworker import errors
from pyworker.db import Database, DatabaseUnavailable

ToolShape = Literal["database", "openai", "anthropic"]
SHAPES: tuple[str, ...] = get_args(ToolShape)


def in_shape(definitions: list[dict[str, Any]], shape: ToolShape) -> list[dict[str, Any]]:
    """The database's ``[{name, description, parameters}]`` in the shape a model API takes:
    ``database`` as served, ``openai`` (``{"type": "function", "function": {...}}``),
    ``anthropic`` (``{name, description, input_schema}``). Nothing in a schema changes."""
    if shape == "database":
        return definitions
    if shape == "openai":
        return [{"type": "function", "function": dict(d)} for d in definitions]
    if shape == "anthropic":
        return [{"name": d["name"], "description": d["description"],
                 "input_schema": d["parameters"]} for d in definitions]
    raise ValueError(f"no tool shape {shape!r}: the shapes are {', '.join(SHAPES)}")


def tool_definitions(dsn: str) -> list[dict[str, Any]]:
    """The tool definitions the database serves (``memory.tool_definitions()``)."""
    db = Database(dsn, application_name="pimem-tools")
    try:
        return db.call("tool_definitions")  # type: ignore[no-any-return]
    finally:
        db.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pyworker.tools",
        description="Print the memory tools' definitions (JSON) as the database serves them.")
    parser.add_argument("--dsn", default=os.environ.get("PIMEM_DSN"),
                        help="libpq connection string or URI of the memory database "
                             "(or PIMEM_DSN); a role that is a memory_backend")
    parser.add_argument("--shape", choices=SHAPES, default="database",
                        help="as the database serves them (default), or in the shape of "
                             "OpenAI's or Anthropic's API")
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("give --dsn or set PIMEM_DSN")
    try:
        definitions = tool_definitions(args.dsn)
    except (DatabaseUnavailable, errors.MemoryError_, psycopg.Error) as exc:
        print(f"pyworker.tools: {str(exc).strip()}", file=sys.stderr)
        return 1
    print(json.dumps(in_shape(definitions, args.shape), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
