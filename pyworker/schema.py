"""The canonical schema (``sql/``) and the migrations (``migrations/``).

``sql/*.sql`` is the canonical definition, applied in name order. The yoyo migrations in
``migrations/`` must build exactly the same schema; ``tests/test_migrations.py`` proves it.
See docs/migrations.md for how function bodies are versioned.
"""

from __future__ import annotations

from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
SQL_DIR = ROOT / "sql"
MIGRATIONS_DIR = ROOT / "migrations"


def canonical_files() -> list[Path]:
    """The canonical SQL files in the order they are applied."""
    return sorted(SQL_DIR.glob("*.sql"))


def canonical_sql() -> str:
    """The whole canonical schema as one script."""
    parts = []
    for path in canonical_files():
        parts.append(f"-- ==== {path.name} ====\n{path.read_text()}")
    return "\n".join(parts)


def apply_canonical(conn: psycopg.Connection) -> None:
    """Builds the schema from ``sql/`` in one transaction (for tests and the drift check)."""
    with conn.transaction():
        conn.execute(canonical_sql().encode())


def yoyo_url(dsn: str) -> str:
    """A yoyo database URL for a libpq DSN or URI (psycopg 3 backend)."""
    if dsn.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + dsn.split("://", 1)[1]
    # key=value DSN: let psycopg parse it, then rebuild a URL.
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    from urllib.parse import quote

    user = quote(str(info.get("user", "")), safe="")
    password = info.get("password")
    auth = user + (":" + quote(str(password), safe="") if password else "")
    host = str(info.get("host", ""))
    port = info.get("port")
    dbname = quote(str(info.get("dbname", "")), safe="")
    netloc = (auth + "@" if auth else "") + ("" if host.startswith("/") else host)
    netloc += f":{port}" if port and not host.startswith("/") else ""
    query = []
    if host.startswith("/"):
        query.append("host=" + quote(host, safe=""))
        if port:
            query.append(f"port={port}")
    return f"postgresql+psycopg://{netloc}/{dbname}" + ("?" + "&".join(query) if query else "")


def migrate(dsn: str) -> list[str]:
    """Applies every pending yoyo migration; returns the ids applied (empty when up to date)."""
    from yoyo import get_backend, read_migrations

    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(MIGRATIONS_DIR))
    with backend.lock():
        pending = backend.to_apply(migrations)
        backend.apply_migrations(pending)
    return [m.id for m in pending]


INITIAL_MIGRATION = MIGRATIONS_DIR / "0001_initial.sql"
BUNDLE_HEADER = """\
-- 0001_initial: the first release of the schema, bundled from sql/ by `pimem schema-bundle`.
-- Until the first release is tagged this file is regenerated from sql/; after it, it is frozen
-- and every change ships as a new migration (see docs/migrations.md).
"""


def write_initial_migration() -> Path:
    """Regenerates the unreleased first migration from the canonical files."""
    INITIAL_MIGRATION.write_text(BUNDLE_HEADER + "\n" + canonical_sql())
    return INITIAL_MIGRATION
