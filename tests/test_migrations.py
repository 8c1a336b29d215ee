"""The yoyo migrations build exactly the canonical schema, and re-applying them is a no-op."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker import schema
from pyworker.cli import app
from tests.catalog import snapshot
from tests.conftest import Server


def _empty_db(pg_server: Server, name: str) -> str:
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"drop database if exists {name} with (force)")
        admin.execute(f"create database {name}")
    return pg_server.dsn(name)


@pytest.mark.no_citus("compares with the one-server build of sql/; the Citus profile's database has the "
                      "cluster's form (tests/test_citus.py checks that one)")
def test_migrations_from_empty_build_exactly_the_canonical_schema(
    pg_server: Server, db_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrated = _empty_db(pg_server, "t_migrated")
    applied = schema.migrate(migrated)
    assert applied, "an empty database must have pending migrations"
    # yoyo prints the rows of any statement of a migration that returns some (a backfill's
    # select); migrate keeps them off the caller's output (pimem migrate, the demo, the eval).
    assert capsys.readouterr().out == ""
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
    from yoyo.connections import parse_uri

    assert schema.yoyo_url("postgresql://u:p@h:5/db") == "postgresql+psycopg://u:p@/db?host=h&port=5"
    assert (schema.yoyo_url("host=127.0.0.1 port=5433 user=postgres dbname=x")
            == "postgresql+psycopg://postgres@/x?host=127.0.0.1&port=5433")
    assert (schema.yoyo_url("host=/tmp/s port=5 user=u dbname=d")
            == "postgresql+psycopg://u@/d?host=%2Ftmp%2Fs&port=5")
    # Whatever libpq accepts reaches psycopg.connect unchanged, every parameter kept: an IPv6
    # address, a host list, brackets in a socket directory, sslmode, a password with '@'.
    for dsn, args in (
            ("host=::1 port=5 dbname=d", {"host": "::1", "port": "5"}),
            ("postgresql://u@h1:5,h2:6/d?sslmode=require",
             {"host": "h1,h2", "port": "5,6", "sslmode": "require"}),
            ("host=/tmp/[/x] dbname=d", {"host": "/tmp/[/x]"}),
            ("host=h user=u password=p@ss:/w dbname=d options='-c x=1'",
             {"host": "h", "options": "-c x=1"})):
        uri = parse_uri(schema.yoyo_url(dsn))
        assert uri.args == args and uri.database == "d", dsn
    assert parse_uri(schema.yoyo_url("host=h user=u password=p@ss:/w dbname=d")).password \
        == "p@ss:/w"
    with pytest.raises(schema.MigrateError, match="not a connection string"):
        schema.yoyo_url("host=h port")


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


# pimem migrate cannot lie -------------------------------------------------------------------

BUMP = """create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select {n} $$;
"""


def _migrations_dir(tmp_path: Path, name: str, extra: dict[str, str]) -> Path:
    """A copy of the package's migrations plus ``extra`` files (name -> SQL)."""
    target = tmp_path / name
    target.mkdir()
    for path in schema.migration_files():
        shutil.copyfile(path, target / path.name)
    for file, text in extra.items():
        (target / file).write_text(text)
    return target


def _has_memory_schema(dsn: str) -> bool:
    with psycopg.connect(dsn) as c:
        return c.execute("select to_regnamespace('memory') is not null").fetchone() == (True,)


def test_the_schema_version_is_the_number_of_the_last_migration(conn: psycopg.Connection) -> None:
    last = schema.migration_files()[-1].name
    assert conn.execute("select memory.schema_version()").fetchone() == (int(last[:4]),)
    assert schema.expected_version() == int(last[:4])


def test_every_migration_is_named_with_a_unique_number() -> None:
    names = [p.name for p in sorted(schema.MIGRATIONS_DIR.glob("*.sql"))
             if not schema.POST_APPLY_NAME.match(p.name)]
    assert names and all(schema.MIGRATION_NAME.match(n) for n in names), names
    assert len({n[:4] for n in names}) == len(names)


def test_migrate_without_migrations_fails_saying_so_and_changes_nothing(
        pg_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dsn = _empty_db(pg_server, "t_none")
    with pytest.raises(schema.MigrateError, match="no migrations found"):
        schema.migrate(dsn, directory=tmp_path)
    monkeypatch.setattr(schema, "MIGRATIONS_DIR", tmp_path)
    result = CliRunner().invoke(app, ["migrate", "--dsn", dsn])
    assert result.exit_code == 1
    assert "no migrations found" in result.output and "up to date" not in result.output
    with psycopg.connect(dsn) as c:
        assert c.execute("select to_regclass('_yoyo_migration')").fetchone() == (None,)


def test_migrate_fails_when_a_migration_forgets_the_schema_version(
        pg_server: Server, tmp_path: Path) -> None:
    source = _migrations_dir(tmp_path, "forgot", {
        "9001_no_bump.sql": "comment on schema memory_private is 'changed, version not bumped';\n"})
    dsn = _empty_db(pg_server, "t_forgot")
    with pytest.raises(schema.MigrateError, match="does not set memory.schema_version"):
        schema.migrate(dsn, directory=source)


def test_migrate_fails_against_a_database_newer_than_the_package(
        pg_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    newer = _migrations_dir(tmp_path, "newer", {"9001_later.sql": BUMP.format(n=9001)})
    dsn = _empty_db(pg_server, "t_newer")
    assert schema.migrate(dsn, directory=newer)[-1] == "9001_later"
    with pytest.raises(schema.MigrateError, match="newer than this pimem"):
        schema.migrate(dsn)
    result = CliRunner().invoke(app, ["migrate", "--check", "--dsn", dsn])
    assert result.exit_code == 2 and "9001_later" in result.output
    monkeypatch.setattr(schema, "MIGRATIONS_DIR", newer)
    assert CliRunner().invoke(app, ["migrate", "--check", "--dsn", dsn]).exit_code == 0


def test_migrate_check_exits_1_while_migrations_are_pending_and_changes_nothing(
        pg_server: Server) -> None:
    dsn = _empty_db(pg_server, "t_check")
    pending = CliRunner().invoke(app, ["migrate", "--check", "--dsn", dsn])
    assert pending.exit_code == 1, pending.output
    assert schema.migration_files()[0].stem in pending.output
    assert not _has_memory_schema(dsn)
    with psycopg.connect(dsn) as c:
        assert c.execute("select to_regclass('yoyo_lock')").fetchone() == (None,)
    migrated = CliRunner().invoke(app, ["migrate", "--dsn", dsn], env={"COLUMNS": "40"})
    assert migrated.exit_code == 0 and "applied" in migrated.output
    # one name a line, whole and without trailing spaces, whatever the width
    names = [f.stem for f in schema.migration_files()]
    assert [line.strip() for line in migrated.output.splitlines()[1:len(names) + 1]] == names
    assert all(line == line.rstrip() for line in migrated.output.splitlines())
    current = CliRunner().invoke(app, ["migrate", "--check", "--dsn", dsn])
    assert current.exit_code == 0 and "up to date" in current.output
    again = CliRunner().invoke(app, ["migrate", "--dsn", dsn])
    assert again.exit_code == 0 and "already up to date" in again.output


def _pimem_migrate(dsn: str) -> subprocess.Popen[str]:
    pimem = Path(sys.executable).parent / "pimem"
    return subprocess.Popen([str(pimem), "migrate", "--dsn", dsn], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, COLUMNS="200"))


def _connections(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("select count(*) from pg_stat_activity "
                        "where datname = current_database() and pid <> pg_backend_pid()"
                        ).fetchone()
        return int(row[0]) if row else 0


@pytest.mark.slow  # two migrate processes, repeated
def test_two_concurrent_migrate_processes_apply_each_migration_once(pg_server: Server) -> None:
    """Two real `pimem migrate` processes queue on yoyo's lock: while this test holds it, both
    connect and wait; once it is released, one applies everything and the other finds nothing
    left. A bare simultaneous start on a fresh database (racing to create yoyo's tables) ends
    well too."""
    from yoyo import get_backend

    # 1. both start at once on an empty database
    fresh = _empty_db(pg_server, "t_race_fresh")
    racers = [_pimem_migrate(fresh), _pimem_migrate(fresh)]
    outs = [p.communicate(timeout=300)[0] for p in racers]
    assert [p.returncode for p in racers] == [0, 0], outs
    assert sorted("applied" in o for o in outs) == [False, True], outs
    # 2. both are waiting on the lock before either may start
    dsn = _empty_db(pg_server, "t_race_lock")
    holder = get_backend(schema.yoyo_url(dsn))
    procs: list[subprocess.Popen[str]] = []
    try:
        with holder.lock():
            procs = [_pimem_migrate(dsn), _pimem_migrate(dsn)]
            deadline = time.monotonic() + 120
            while _connections(dsn) < 3:  # the holder and both migrates are connected
                assert time.monotonic() < deadline, "the migrate processes did not connect"
                assert all(p.poll() is None for p in procs), "a migrate did not wait for the lock"
                time.sleep(0.05)  # waiting for other processes, not for the memory clock
            assert not _has_memory_schema(dsn)
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        holder.connection.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("applied" in o for o in outs) == [False, True], outs
    with psycopg.connect(dsn) as c:
        applied = c.execute("select migration_id from _yoyo_migration").fetchall()
        assert sorted(r[0] for r in applied) == [p.stem for p in schema.migration_files()]


# The drift check sees what it must ------------------------------------------------------------


def test_the_drift_check_sees_triggers_seed_rows_grants_default_privileges_and_memberships(
        fresh_conn: psycopg.Connection) -> None:
    conn = fresh_conn  # a database of its own: the test changes the schema
    before = snapshot(conn)
    changes = {
        "triggers": "alter table memory_private.jobs disable trigger jobs_check_transition",
        "reference_rows": "delete from memory_private.redaction_patterns where ctid = "
                          "(select min(ctid) from memory_private.redaction_patterns)",
        "functions": "grant execute on function memory.schema_version() to public",
        "default_privileges": "alter default privileges in schema memory_private "
                              "grant select on tables to memory_operator",
        "role_memberships": "grant memory_worker to memory_operator",
    }
    try:
        for part, statement in changes.items():
            conn.execute(statement)
            after = snapshot(conn)
            assert after[part] != before[part], f"the snapshot misses a change of {part}"
            before = after
    finally:
        conn.execute("revoke memory_worker from memory_operator")
