"""The yoyo migrations build exactly the canonical schema, and re-applying them is a no-op."""

from __future__ import annotations

import psycopg

from pyworker import schema
from tests.catalog import snapshot
from tests.conftest import Server


def _empty_db(pg_server: Server, name: str) -> str:
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"drop database if exists {name} with (force)")
        admin.execute(f"create database {name}")
    return pg_server.dsn(name)


def test_migrations_from_empty_build_exactly_the_canonical_schema(
    pg_server: Server, db_dsn: str
) -> None:
    migrated = _empty_db(pg_server, "t_migrated")
    applied = schema.migrate(migrated)
    assert applied, "an empty database must have pending migrations"
    with psycopg.connect(migrated) as m, psycopg.connect(db_dsn) as c:
        got, want = snapshot(m), snapshot(c)
    for part in want:
        assert got[part] == want[part], (
            f"migrations drift from sql/ in {part}; regenerate the unreleased migration with "
            "`pimem schema-bundle` or add a migration"
        )


def test_migrate_twice_is_idempotent(pg_server: Server) -> None:
    dsn = _empty_db(pg_server, "t_twice")
    assert schema.migrate(dsn)
    with psycopg.connect(dsn) as c:
        before = snapshot(c)
    assert schema.migrate(dsn) == []
    with psycopg.connect(dsn) as c:
        assert snapshot(c) == before


def test_migrate_accepts_key_value_and_uri_dsns() -> None:
    assert schema.yoyo_url("postgresql://u:p@h:5/db") == "postgresql+psycopg://u:p@h:5/db"
    assert (schema.yoyo_url("host=127.0.0.1 port=5433 user=postgres dbname=x")
            == "postgresql+psycopg://postgres@127.0.0.1:5433/x")
    assert (schema.yoyo_url("host=/tmp/s port=5 user=u dbname=d")
            == "postgresql+psycopg://u@/d?host=%2Ftmp%2Fs&port=5")


def test_plain_yoyo_apply_migrates_too(pg_server: Server) -> None:
    import subprocess
    import sys
    from pathlib import Path

    dsn = _empty_db(pg_server, "t_yoyo")
    yoyo = Path(sys.executable).parent / "yoyo"
    result = subprocess.run(
        [str(yoyo), "apply", "--batch", "--no-config-file", "--database", schema.yoyo_url(dsn),
         str(schema.MIGRATIONS_DIR)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(dsn) as c:
        assert c.execute("select count(*) from pg_proc p join pg_namespace n "
                         "on n.oid = p.pronamespace where n.nspname = 'memory'").fetchone()[0] > 5
    assert schema.migrate(dsn) == [], "pimem migrate sees what yoyo applied"
