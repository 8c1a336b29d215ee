"""The harness itself: the shared database is put back to exactly what a fresh clone holds,
a test that opens more connections never gets it, a schema change on it is caught, and the
scheduling order runs every test once with the long ones first."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from tests.conftest import Server, create_clone, drop_database
from tests.factory import World
from tests.jobs_world import idle_private_world, run_one_extraction
from tests.records import make_record
from tests.scheduling import order_for_workers
from tests.shared_db import USER_SCHEMAS, SharedDatabase
from tests.test_recall import manage, query, recall

RELATIONS = f"""
    select quote_ident(n.nspname) || '.' || quote_ident(c.relname), c.relkind
      from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
     where c.relkind in ('r', 'p', 'm', 'S') and c.relpersistence <> 't' and {USER_SCHEMAS}
     order by 1"""

SESSION = """
    select current_user, session_user, current_setting('search_path'),
           current_setting('statement_timeout'), current_setting('lock_timeout'),
           current_setting('session_replication_role'),
           (select count(*) from pg_locks where pid = pg_backend_pid() and locktype = 'advisory'),
           (select count(*) from pg_class where relpersistence = 't'),
           (select count(*) from pg_listening_channels())"""


def contents(conn: psycopg.Connection) -> dict[str, str]:
    """Every table's rows (a digest) and every sequence's state, of every schema but the
    system's, found from the catalog."""
    out = {}
    for name, kind in conn.execute(RELATIONS).fetchall():
        if kind == "S":
            query_ = f"select last_value || ' ' || is_called from {name}"
        else:
            query_ = (f"select count(*) || ' ' || coalesce(md5(string_agg(t::text, E'\\n' "
                      f"order by t::text)), '') from {name} t")
        row = conn.execute(query_).fetchone()
        assert row is not None
        out[name] = str(row[0])
    return out


@pytest.fixture
def clone(pg_server: Server) -> Iterator[str]:
    """A fresh clone of the template made by the test itself (asking for ``db_dsn`` would move
    ``conn`` off the shared database)."""
    name = create_clone(pg_server, "cmp")
    try:
        yield pg_server.dsn(name)
    finally:
        drop_database(pg_server, name)


def busy(conn: psycopg.Connection, seeded: list[str]) -> None:
    """Work through the public API that writes to most tables and moves every sequence, then
    a change to the rows the template itself holds (``seeded``: the clock, the patterns ...)."""
    w = idle_private_world(conn, "ws1", turns=3)
    run_one_extraction(conn, "ws1")
    w.grant("ws1", "alice", "repo-x")
    a, _ = w.conversation("ws1", "g1", chat="grp", topic=7, user="alice",
                          user_text="I like tea")
    make_record(conn, "ws1", "g1", [a])
    w.request("ws1", "q1", chat="dm-alice", user="alice", status="running")
    recall(conn, "ws1", "q1")
    query(conn, "ws1", "q1", "c0", {"limit": 12})
    w.message("ws1", "q1-u", "q1", "user", "alice", "Please remember that I like jazz")
    manage(conn, "ws1", "q1", "c1", {"action": "remember", "sourceId": "q1-u"})
    w.remove("ws1", "g1-u")
    conn.execute("select memory.run_maintenance(null)")
    for name in seeded:
        conn.execute(f"delete from {name} where ctid = (select min(ctid) from {name})")


@pytest.mark.no_citus("the one-server harness: clones of a template, which the Citus profile (one "
                      "distributed database) does not make")
def test_the_reset_leaves_every_table_and_sequence_as_a_fresh_clone_has_them(
        conn: psycopg.Connection, shared_db: SharedDatabase, clone: str) -> None:
    with psycopg.connect(clone, autocommit=True) as fresh:
        expected = contents(fresh)
        fresh_session = fresh.execute(SESSION).fetchone()
    assert conn.info.dbname == psycopg.conninfo.conninfo_to_dict(shared_db.dsn)["dbname"]
    assert contents(conn) == expected, "the shared database starts as a fresh clone"

    kinds = dict(conn.execute(RELATIONS).fetchall())
    seeded = [k for k, v in expected.items() if kinds[k] == "r" and not v.startswith("0 ")]
    sequences = {k for k, kind in kinds.items() if kind == "S"}
    busy(conn, seeded)
    changed = {k for k, v in contents(conn).items() if expected.get(k) != v}
    assert len(changed) >= len(expected) // 2, f"the workload changed only {sorted(changed)}"
    assert seeded and set(seeded) <= changed, "the template's own rows changed"
    assert sequences and sequences <= changed, "the workload moved every sequence"

    # What a test can leave in its session: settings, a role, a temporary table, an advisory
    # lock, a LISTEN, a transaction that failed; and a second connection holding a lock.
    other = psycopg.connect(shared_db.dsn)
    other.execute("lock table memory_private.jobs")
    conn.execute("set statement_timeout = '123s'; set search_path = memory; "
                 "set lock_timeout = '1s'; create temp table harness_t (x int); "
                 "select pg_advisory_lock(42); listen harness")
    conn.autocommit = False
    conn.execute("set role memory_operator")
    with pytest.raises(psycopg.Error):
        conn.execute("insert into memory_private.clock default values")

    assert shared_db.reset() is None
    with pytest.raises(psycopg.OperationalError):
        other.execute("select 1")  # ended by the reset, its lock with it
    other.close()
    same = shared_db.connection()
    assert contents(same) == expected
    assert same.execute(SESSION).fetchone() == fresh_session
    assert same.autocommit


def test_conn_alone_is_the_workers_shared_database(
        conn: psycopg.Connection, shared_db: SharedDatabase) -> None:
    assert conn is shared_db.connection()


@pytest.mark.no_citus("the one-server harness: clones of a template, which the Citus profile (one "
                      "distributed database) does not make")
def test_a_test_asking_for_db_dsn_gets_conn_on_its_own_clone(
        conn: psycopg.Connection, db_dsn: str, shared_db: SharedDatabase) -> None:
    assert conn is not shared_db.connection()
    assert conn.info.dbname == psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"]


@pytest.fixture
def second_connection(db_dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(db_dsn, autocommit=True) as c:
        yield c


@pytest.mark.no_citus("the one-server harness: clones of a template, which the Citus profile (one "
                      "distributed database) does not make")
def test_a_fixture_asking_for_db_dsn_moves_conn_to_the_clone_too(
        conn: psycopg.Connection, second_connection: psycopg.Connection) -> None:
    assert conn.info.dbname == second_connection.info.dbname
    assert conn.info.dbname.startswith("t_")


def test_fresh_conn_is_conn_on_a_clone_of_its_own(
        fresh_conn: psycopg.Connection, conn: psycopg.Connection,
        shared_db: SharedDatabase) -> None:
    assert fresh_conn is conn and conn is not shared_db.connection()


@pytest.mark.no_citus("the one-server harness: clones of a template, which the Citus profile (one "
                      "distributed database) does not make")
def test_the_reset_reports_a_schema_change_and_never_a_change_of_rows(db_dsn: str) -> None:
    db = SharedDatabase(db_dsn)
    try:
        World(db.connection()).basic()
        assert db.reset() is None
        c = db.connection()
        c.execute("alter table memory_private.jobs disable trigger jobs_check_transition")
        c.execute("alter table memory_private.jobs enable trigger jobs_check_transition")
        assert db.reset() is not None, "disabling a trigger for a moment is a schema change"
    finally:
        db.close()
    db = SharedDatabase(db_dsn)
    try:
        db.connection().execute("create function public.f() returns int language sql "
                                "as 'select 1'")
        assert db.reset() is not None
    finally:
        db.close()


@pytest.mark.no_citus("the one-server harness: clones of a template, which the Citus profile (one "
                      "distributed database) does not make")
def test_a_closed_or_killed_shared_connection_is_replaced(db_dsn: str) -> None:
    db = SharedDatabase(db_dsn)
    try:
        db.connection().close()
        assert db.reset() is None and not db.connection().closed
        c = db.connection()
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            admin.execute("select pg_terminate_backend(%s)", (c.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            c.execute("select 1")
        assert db.reset() is None
        assert db.connection().execute("select 1").fetchone() == (1,)
    finally:
        db.close()


@dataclass
class Item:
    nodeid: str


def test_the_order_runs_every_test_once_with_the_slow_ones_first_on_every_worker() -> None:
    items = [Item(f"t{i:03}") for i in range(101)]
    slow = {"t010", "t020", "t030", "t040", "t050", "t090"}
    seconds = {"t010": 70.0, "t020": 72.0, "t030": 30.0, "t040": 20.0, "t050": 4.0,
               "t060": 50.0}  # t090 never recorded: SLOW_DEFAULT (30 s); t060 is not slow
    ordered = order_for_workers(items, seconds, slow, 2)
    assert sorted(i.nodeid for i in ordered) == [i.nodeid for i in items]
    first, second = ordered[:50], ordered[50:]  # what work stealing hands each worker first
    # Longest first, each to the worker with less so far: 72 | 70, 30 | 30, 20, 4.
    assert [i.nodeid for i in first[:3]] == ["t020", "t090", "t050"]
    assert [i.nodeid for i in second[:3]] == ["t010", "t030", "t040"]
    rest = [i.nodeid for i in ordered if i.nodeid not in slow]
    assert rest == sorted(rest), "the other tests keep their order"
