"""The two memory tools a bot offers its model, as the database defines them.

``memory.tool_definitions()`` (role ``memory_backend``, sql/56_tools.sql) returns both as
``[{name, description, parameters}]`` function definitions, their parameters a JSON Schema whose
limits are the ones ``memory.query_memories`` / ``memory.manage_memory`` enforce. A backend in any
language reads them there; a Python backend with :meth:`pyworker.client.MemoryClient.tool_definitions`.
This module only prints them, for a backend that wants them as a file:

    python -m pyworker.tools --dsn "$PIMEM_DSN" > tools.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import psycopg

from pyworker import errors
from pyworker.db import Database, DatabaseUnavailable


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
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("give --dsn or set PIMEM_DSN")
    try:
        definitions = tool_definitions(args.dsn)
    except (DatabaseUnavailable, errors.MemoryError_, psycopg.Error) as exc:
        print(f"pyworker.tools: {str(exc).strip()}", file=sys.stderr)
        return 1
    print(json.dumps(definitions, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
