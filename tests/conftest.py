"""The test database harness.

A throwaway PostgreSQL per test session (per xdist worker), chosen in this order:
1. an explicit DSN in ``PIMEM_TEST_DSN`` (a superuser connection; databases are created in it);
2. the local server binaries (``initdb``/``pg_ctl`` in a temporary directory);
3. testcontainers, when a Docker engine answers;
4. otherwise every database test is skipped with a message naming what to install.

The canonical schema (``sql/``) is built once into a template database. Tests see it two ways:

- ``conn`` alone: the worker's **shared database** (one clone of the template per worker) on one
  long-lived autocommit connection, whose compiled functions and plans stay warm from test to
  test. After every test the harness puts it back to what a fresh clone is (tests/shared_db.py:
  every row deleted and the template's rows restored, every sequence back at the template's
  value, the session's settings, role, locks and temporary objects reset) and checks that the
  test changed no schema object; a test that did fails, and the database is replaced.
- ``db_dsn``: a database of the test's own, a fresh clone dropped after the test, for tests that
  open more connections, run processes, crash servers or change the schema. A test that asks
  for ``db_dsn`` (itself or through any fixture) gets ``conn`` on that same clone, never on the
  shared database. ``fresh_conn`` is ``conn`` on a clone, for a test that needs no DSN but
  changes the schema (creates a function, disables a trigger).

**The Citus profile** (``PIMEM_TEST_CITUS=1``; ``scripts/test`` runs the whole suite so after the
main suite, ``-m "not slow"``): the server is a throwaway Citus cluster (a coordinator and two
workers, ``pyworker.lab.servers.CitusCluster``), the schema is built by ``pimem migrate`` on the
coordinator (which distributes it), and every test runs against that one distributed database:
``conn``, ``db_dsn`` and ``shared_dsn`` alike, reset after every test as the shared database is.
A test that cannot run there says why with ``@pytest.mark.no_citus("reason")`` and is skipped
with that reason. Two kinds are skipped with their reason without a mark of their own: a test
on ``fresh_conn`` (it changes the schema, and the profile has one database), and a test that
reaches no database of the cluster (none of ``conn``, ``db_dsn``, ``shared_dsn``: no database
at all, or one of its own on plain PostgreSQL), which would only run again what the main suite
ran. Every test is skipped when Citus is not installed (one line says why).

The long profiles carry ``@pytest.mark.slow``: the full suite runs them, ``scripts/test --quick``
(``-m "not slow"``) leaves them out. Under xdist the slow tests start first, spread over the
workers, and an idle worker steals from a busy one (tests/scheduling.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pyworker import schema
from pyworker.lab.servers import CitusCluster, LocalCluster, citus_available, find_bindir
from tests.shared_db import SharedDatabase

pytest_plugins = ["tests.scheduling"]  # the long tests first, work stealing (under xdist)

TEMPLATE = "pimem_template"
CITUS = os.environ.get("PIMEM_TEST_CITUS") == "1"
CITUS_DATABASE = "pimem_citus"
INSTALL_HINT = (
    "no PostgreSQL for the tests: set PIMEM_TEST_DSN, or install the server binaries "
    "(apt-get install postgresql-15 postgresql-15-pgtap libtap-parser-sourcehandler-pgtap-perl), "
    "or run a Docker engine for testcontainers"
)


@dataclass
class Server:
    """A running server the tests may create databases in."""

    admin_dsn: str
    cluster: LocalCluster | None = None
    has_pgtap: bool = False
    citus: CitusCluster | None = None  # the Citus profile's cluster (admin_dsn: its coordinator)

    def dsn(self, dbname: str) -> str:
        info = psycopg.conninfo.conninfo_to_dict(self.admin_dsn)
        info["dbname"] = dbname
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def cluster_parent() -> str | None:
    """Where throwaway clusters keep their files: ``PIMEM_TEST_PGDIR`` when set, else
    ``/dev/shm`` when it is writable with 2 GB free (memory: on a disk the other suites of the
    machine also write to, a ``CREATE DATABASE`` took 370-540 ms, in memory 33-43 ms), else the
    system's temporary directory."""
    chosen = os.environ.get("PIMEM_TEST_PGDIR")
    if chosen:
        return chosen
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 << 30:
        return shm
    return None


def local_cluster(bindir: Path, settings: dict[str, str] | None = None) -> LocalCluster:
    """A :class:`LocalCluster` (not started) whose directory is under :func:`cluster_parent`."""
    saved = tempfile.tempdir
    tempfile.tempdir = cluster_parent() or saved  # LocalCluster makes its directory there
    try:
        return LocalCluster(bindir, settings=settings)
    finally:
        tempfile.tempdir = saved


# The test server writes no more WAL than crash safety needs (a clone then writes none, and the
# memory its files take stays small); nothing in the tests replicates.
TEST_SERVER_SETTINGS = {"wal_level": "minimal", "max_wal_senders": "0"}


def start_citus_cluster(settings: dict[str, str] | None = None) -> CitusCluster:
    """A started throwaway Citus cluster (its nodes' ``settings`` added to
    CITUS_NODE_SETTINGS) whose nodes keep their files under :func:`cluster_parent`; skips the
    test, saying why, when Citus is not installed."""
    bindir = find_bindir()
    reason = citus_available(bindir)
    if reason is not None or bindir is None:
        pytest.skip(f"no Citus cluster: {reason}")
    saved = tempfile.tempdir
    tempfile.tempdir = cluster_parent() or saved  # the nodes' directories
    try:
        return CitusCluster(bindir, settings=settings).start()
    finally:
        tempfile.tempdir = saved


def _start_citus() -> tuple[Server | None, object]:
    citus = start_citus_cluster()
    return Server(citus.coordinator.dsn(), citus=citus), citus


def _start_server() -> tuple[Server | None, object]:
    if CITUS:
        return _start_citus()
    dsn = os.environ.get("PIMEM_TEST_DSN")
    if dsn:
        return Server(dsn), None
    bindir = find_bindir()
    if bindir is not None and (bindir / "initdb").exists():
        cluster = local_cluster(bindir, TEST_SERVER_SETTINGS).init().start()
        return Server(cluster.dsn(), cluster=cluster), cluster
    try:
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:15", driver=None)
        container.start()
        container.exec("sh -c 'apt-get update && apt-get install -y postgresql-15-pgtap'")
        return Server(container.get_connection_url()), container
    except Exception:  # noqa: BLE001 - no Docker engine: fall through to the skip
        return None, None


def _build_template(server: Server) -> None:
    if server.citus is not None:
        # No template on a cluster: one database, built and distributed by pimem migrate.
        dsn = server.citus.create_database(CITUS_DATABASE)
        schema.migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                conn.execute("create extension if not exists pgtap")
                server.has_pgtap = True
            except psycopg.Error:
                server.has_pgtap = False
        return
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"drop database if exists {TEMPLATE}")
        admin.execute(f"create database {TEMPLATE}")
    with psycopg.connect(server.dsn(TEMPLATE)) as conn:
        schema.apply_canonical(conn)
        try:
            with conn.transaction():
                conn.execute("create extension if not exists pgtap")
            server.has_pgtap = True
        except psycopg.Error:
            server.has_pgtap = False


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    server, handle = _start_server()
    if server is None:
        pytest.skip(INSTALL_HINT)
    try:
        _build_template(server)
        yield server
    finally:
        if isinstance(handle, (LocalCluster, CitusCluster)):
            handle.destroy()
        elif handle is not None:
            handle.stop()  # type: ignore[attr-defined]


_counter = itertools.count()


def create_clone(server: Server, prefix: str = "t") -> str:
    """A new database cloned from the template; returns its name."""
    name = f"{prefix}_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"create database {name} template {TEMPLATE}")
    return name


def drop_database(server: Server, name: str) -> None:
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"drop database if exists {name} with (force)")


class Clones:
    """Fresh clones for ``db_dsn``, made one ahead and dropped behind the tests, by one thread.

    A clone is made while the test before runs (the next test that asks for one gets it at
    once), and a used one is dropped while the next test runs: ``DROP DATABASE`` waits in steps
    of 100 ms for the test's closed connections to go away. The session waits for both at its
    end. Every clone is still made from the template and used by one test only."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clones")
        self.next: Future[str] | None = None
        self.drops: list[Future[None]] = []

    def take(self) -> str:
        ahead, self.next = self.next, None
        name = ahead.result() if ahead is not None else create_clone(self.server)
        self.next = self.thread.submit(create_clone, self.server)
        return name

    def give_back(self, name: str) -> None:
        self.drops.append(self.thread.submit(drop_database, self.server, name))

    def close(self) -> None:
        """Waits for the clones' drops; a drop that failed fails here."""
        if self.next is not None:
            self.give_back(self.next.result())
        self.thread.shutdown(wait=True)
        for drop in self.drops:
            drop.result()


@pytest.fixture(scope="session")
def clones(pg_server: Server) -> Iterator[Clones]:
    made = Clones(pg_server)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def db_dsn(request: pytest.FixtureRequest, pg_server: Server) -> Iterator[str]:
    """A fresh database cloned from the template for this test alone; dropped after it. In the
    Citus profile: the distributed database, reset after the test."""
    if pg_server.citus is not None:
        shared: SharedDatabase = request.getfixturevalue("shared_db")
        shared.connection()
        yield shared.dsn
        _reset_or_fail(shared, pg_server)
        return
    clones: Clones = request.getfixturevalue("clones")
    name = clones.take()
    try:
        yield pg_server.dsn(name)
    finally:
        clones.give_back(name)


@pytest.fixture(scope="session")
def shared_db(pg_server: Server) -> Iterator[SharedDatabase]:
    """The worker's shared database (tests/shared_db.py). Tests get it through ``conn``."""
    if pg_server.citus is not None:
        citus_shared = SharedDatabase(pg_server.dsn(CITUS_DATABASE))
        try:
            yield citus_shared
        finally:
            citus_shared.close()
        return
    name = create_clone(pg_server, "shared")
    shared = SharedDatabase(pg_server.dsn(name))
    try:
        yield shared
    finally:
        shared.close()
        drop_database(pg_server, name)


def _reset_or_fail(shared: SharedDatabase, pg_server: Server) -> None:
    problem = shared.reset()
    if problem is not None and pg_server.citus is not None:
        pytest.fail(f"{problem}: the Citus profile has one database; a test that changes the "
                    "schema is marked no_citus", pytrace=False)
    if problem is not None:
        # The schema is no longer the template's: replace the database, then fail the test.
        old = shared.dsn
        shared.replace(pg_server.dsn(create_clone(pg_server, "shared")))
        drop_database(pg_server, str(psycopg.conninfo.conninfo_to_dict(old)["dbname"]))
        pytest.fail(f"{problem}: a test that changes the schema asks for `fresh_conn` (or "
                    "`db_dsn`), a database of its own; `conn` alone is the shared database",
                    pytrace=False)


@pytest.fixture
def conn(request: pytest.FixtureRequest, pg_server: Server) -> Iterator[psycopg.Connection]:
    """An autocommit superuser connection: to the test's own clone when the test (or any of its
    fixtures) asks for ``db_dsn``, else to the worker's shared database, reset after the test."""
    if "db_dsn" in request.fixturenames and pg_server.citus is None:
        with psycopg.connect(request.getfixturevalue("db_dsn"), autocommit=True) as c:
            yield c
        return
    if "db_dsn" in request.fixturenames:  # the Citus profile: db_dsn resets the database
        request.getfixturevalue("db_dsn")
        shared_c: SharedDatabase = request.getfixturevalue("shared_db")
        yield shared_c.connection()
        return
    shared: SharedDatabase = request.getfixturevalue("shared_db")
    yield shared.connection()
    _reset_or_fail(shared, pg_server)


@pytest.fixture
def fresh_conn(db_dsn: str, conn: psycopg.Connection) -> psycopg.Connection:
    """``conn`` on a database of this test's own (a fresh clone), for a test that changes the
    schema; ``conn`` and its fixtures are on the same clone."""
    return conn


@pytest.fixture
def shared_dsn(request: pytest.FixtureRequest, pg_server: Server) -> Iterator[str]:
    """The DSN of the worker's shared database, for a tool that connects by itself and leaves
    nothing behind (pg_prove: every pgTAP file rolls back). The database is reset after the test
    as after ``conn``; other connections to it are closed then."""
    if "db_dsn" in request.fixturenames and pg_server.citus is None:
        pytest.fail("a test asks for db_dsn or shared_dsn, not both", pytrace=False)
    shared: SharedDatabase = request.getfixturevalue("shared_db")
    shared.connection()
    yield shared.dsn
    _reset_or_fail(shared, pg_server)


# The fixtures that reach the Citus profile's distributed database.
CLUSTER_FIXTURES = frozenset({"conn", "db_dsn", "shared_dsn", "shared_db"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the Citus profile, the tests marked ``no_citus`` are skipped with their reason, and so
    are, each with its reason, a test on ``fresh_conn`` (it changes the schema) and a test that
    reaches no database of the cluster (none at all, or one of its own on plain PostgreSQL:
    the main suite runs it as it is)."""
    if not CITUS:
        return
    for item in items:
        marker = item.get_closest_marker("no_citus")
        fixtures = set(getattr(item, "fixturenames", ()))
        if marker is None and "fresh_conn" in fixtures:
            marker = pytest.mark.no_citus("changes the schema (fresh_conn), and the Citus "
                                          "profile has one database").mark
        elif marker is None and not fixtures & CLUSTER_FIXTURES:
            marker = pytest.mark.no_citus("uses no database of the cluster (none, or one of "
                                          "its own): the main suite runs it as it is").mark
        if marker is not None:
            reason = marker.args[0] if marker.args else "not in the Citus profile"
            item.add_marker(pytest.mark.skip(reason=f"Citus profile: {reason}"))


_empty = itertools.count()


@pytest.fixture
def empty_dsn(pg_server: Server) -> Iterator[str]:
    """A new empty database (no schema: for a test that migrates it itself); dropped after."""
    name = f"empty_{os.getpid()}_{next(_empty)}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"create database {name}")
    try:
        yield pg_server.dsn(name)
    finally:
        drop_database(pg_server, name)
