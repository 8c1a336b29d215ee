"""The worker's shared test database: one clone of the template per test process, on one
long-lived connection, put back to the state of a fresh clone after every test.

A fresh clone costs a ``CREATE DATABASE`` (150-400 ms on the shared 2-core machine) and a new
connection that compiles every PL/pgSQL function again on its first calls. Most tests use one
connection and change only rows, so they share this database; ``reset`` undoes what a test can
do through one connection, and ``tests/test_harness.py`` proves it leaves every table and
sequence as a fresh clone has them. Everything is read from the catalog when the database is
opened, so a new table, sequence or reference row needs no change here.

Not a rolled-back transaction per test: a transaction freezes ``now()`` and is broken by the
first error a test expects; the tests see autocommit, as on a clone.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

# Every schema but the system's: the memory schemas, pgTAP's, and any a later change adds.
USER_SCHEMAS = """n.nspname not in ('pg_catalog', 'information_schema')
                  and n.nspname not like 'pg\\_toast%' and n.nspname not like 'pg\\_temp%'"""

TABLES = f"""
    select n.nspname, c.relname
      from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where c.relkind = 'r' and c.relpersistence <> 't' and {USER_SCHEMAS}
     order by 1, 2"""

SEQUENCES = f"""
    select n.nspname, c.relname
      from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where c.relkind = 'S' and c.relpersistence <> 't' and {USER_SCHEMAS}
     order by 1, 2"""

# The columns COPY can write (not the generated ones), in order.
COLUMNS = """
    select a.attname from pg_catalog.pg_attribute a
     where a.attrelid = %s::regclass and a.attnum > 0 and not a.attisdropped
       and a.attgenerated = ''
     order by a.attnum"""

# What a schema change writes: a row of one of these catalogs (of this database) added,
# removed or rewritten. Row counts and the sum of the rows' creating transactions change with
# any DDL (CREATE, ALTER incl. DISABLE TRIGGER, DROP, GRANT, COMMENT, TRUNCATE), and with
# nothing a test does to rows. Temporary objects are discarded before the check.
CATALOGS = ("pg_class", "pg_attribute", "pg_attrdef", "pg_proc", "pg_trigger", "pg_constraint",
            "pg_index", "pg_namespace", "pg_type", "pg_rewrite", "pg_policy", "pg_description",
            "pg_sequence", "pg_inherits", "pg_extension", "pg_event_trigger", "pg_default_acl",
            "pg_enum", "pg_operator", "pg_cast", "pg_aggregate", "pg_statistic_ext",
            "pg_publication", "pg_largeobject_metadata")
# A session's first temporary table creates its temporary schemas for good: not a change.
_WHERE = {"pg_namespace": "where nspname not like 'pg\\_temp\\_%' "
                          "and nspname not like 'pg\\_toast\\_temp\\_%'"}
FINGERPRINT = "select " + " || ' ' || ".join(
    f"(select count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) from pg_catalog.{c} "
    f"{_WHERE.get(c, '')})" for c in CATALOGS)
# On a Citus cluster the reset truncates (a delete of every shard's rows fans out into one
# connection per shard and table), which rewrites pg_class rows: there only their count counts.
CITUS_FINGERPRINT = FINGERPRINT.replace(
    "(select count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) from pg_catalog.pg_class )",
    "(select count(*) from pg_catalog.pg_class)")

# What a session can carry from one test to the next. Other client connections to the
# database (a tool such as pg_prove that has just exited) are ended and waited for.
SESSION_RESET = """
    set session authorization default;
    reset all;
    close all;
    unlisten *;
    select pg_catalog.pg_advisory_unlock_all();
    discard temp;
    discard sequences;
    select pg_catalog.pg_terminate_backend(pid, 5000) from pg_catalog.pg_stat_activity
     where datname = pg_catalog.current_database() and pid <> pg_catalog.pg_backend_pid()
       and backend_type = 'client backend';
"""


@dataclass
class _Table:
    name: sql.Composable
    columns: sql.Composable
    rows: bytes  # the template's rows, COPY binary; b"" when it has none


class SharedDatabase:
    """One database and one connection reused by every ``conn`` test of a worker."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection | None = None
        self.citus = False
        self._read_template_state()

    def _connect(self) -> psycopg.Connection:
        self._conn = psycopg.connect(self.dsn, autocommit=True)
        return self._conn

    def _read_template_state(self) -> None:
        """What a fresh clone holds, read once from the still untouched database."""
        conn = self._connect()
        self.tables: list[_Table] = []
        for schema, table in conn.execute(TABLES).fetchall():
            name = sql.Identifier(schema, table)
            columns = sql.SQL(", ").join(
                sql.Identifier(r[0]) for r in conn.execute(
                    COLUMNS, (f'"{schema}"."{table}"',)).fetchall())
            with conn.cursor().copy(sql.SQL("copy {} ({}) to stdout (format binary)").format(
                    name, columns)) as copy:
                data = b"".join(bytes(chunk) for chunk in copy)
            has_rows = conn.execute(sql.SQL("select exists (select 1 from {})").format(name)
                                    ).fetchone()
            self.tables.append(_Table(name, columns, data if has_rows and has_rows[0] else b""))
        setvals: list[sql.Composable] = []
        for schema, seq in conn.execute(SEQUENCES).fetchall():
            name = sql.Identifier(schema, seq)
            row = conn.execute(sql.SQL("select last_value, is_called from {}").format(name)
                               ).fetchone()
            assert row is not None
            setvals.append(sql.SQL("select pg_catalog.setval({}::regclass, {}, {});").format(
                sql.Literal(name.as_string(conn)), sql.Literal(int(row[0])),
                sql.Literal(bool(row[1]))))
        self.restore_sequences = sql.SQL(" ").join(setvals) if setvals else None
        # On a Citus coordinator the two settings must reach the workers' connections too.
        citus = conn.execute("select exists (select from pg_catalog.pg_extension "
                             "where extname = 'citus')").fetchone()
        propagate = [sql.SQL("set local citus.propagate_set_commands = 'local';")] \
            if citus and citus[0] else []
        self.citus = bool(citus and citus[0])
        if self.citus:
            self.delete_all = sql.SQL("truncate {};").format(
                sql.SQL(", ").join(t.name for t in self.tables))
            self.fingerprint = self._fingerprint(conn)
            return
        self.delete_all = sql.SQL(" ").join(
            propagate
            + [sql.SQL("set local session_replication_role = replica;"),  # no triggers, no FKs
             sql.SQL("set local lock_timeout = '30s';")]  # never hang on a lock left behind
            + [sql.SQL("delete from {};").format(t.name) for t in self.tables])
        self.fingerprint = self._fingerprint(conn)

    def _fingerprint(self, conn: psycopg.Connection) -> str:
        row = conn.execute(CITUS_FINGERPRINT if self.citus else FINGERPRINT).fetchone()
        assert row is not None
        return str(row[0])

    def connection(self) -> psycopg.Connection:
        """The shared connection, opened again if a test closed or broke it."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            return self._connect()
        return self._conn

    def _clean_session(self) -> psycopg.Connection:
        """The connection with nothing left of the last test's session: a transaction left
        open is rolled back, the client-side settings are the defaults again. Anything odd
        (closed, broken, in COPY or a pipeline) gets a new connection instead."""
        conn = self._conn
        try:
            if conn is None or conn.closed or conn.broken:
                raise psycopg.OperationalError("no usable connection")
            conn.rollback()
            conn.autocommit = True
            conn.read_only = None
            conn.isolation_level = None
            conn.deferrable = None
            conn.row_factory = tuple_row
            conn.prepare_threshold = 5
            conn.execute(SESSION_RESET)
            return conn
        except psycopg.Error:
            if conn is not None:
                conn.close()
            conn = self._connect()
            conn.execute(SESSION_RESET)
            return conn

    def reset(self) -> str | None:
        """Puts the database back to the template's state. Returns what is wrong when the
        schema itself changed (rows alone never are), else None."""
        conn = self._clean_session()
        with conn.transaction():
            conn.execute(self.delete_all)
            with conn.cursor() as cur:
                for table in self.tables:
                    if table.rows:
                        with cur.copy(sql.SQL("copy {} ({}) from stdin (format binary)").format(
                                table.name, table.columns)) as copy:
                            copy.write(table.rows)
        if self.restore_sequences is not None:
            conn.execute(self.restore_sequences)
        now = self._fingerprint(conn)
        if now != self.fingerprint:
            return "the test changed the schema of the shared database"
        return None

    def replace(self, dsn: str) -> None:
        """Moves to a new database (after a test changed the schema of this one)."""
        self.close()
        self.dsn = dsn
        self._read_template_state()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
