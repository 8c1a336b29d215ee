"""The test database harness.

A throwaway PostgreSQL per test session, chosen in this order:
1. an explicit DSN in ``PIMEM_TEST_DSN`` (a superuser connection; databases are created in it);
2. the local server binaries (``initdb``/``pg_ctl`` in a temporary directory);
3. testcontainers, when a Docker engine answers;
4. otherwise every database test is skipped with a message naming what to install.

The canonical schema (``sql/``) is built once into a template database, and every test gets a
fresh clone of it (``CREATE DATABASE ... TEMPLATE``), so tests never see each other's rows.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from pyworker import schema
from pyworker.servers import LocalCluster, find_bindir

TEMPLATE = "pimem_template"
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

    def dsn(self, dbname: str) -> str:
        info = psycopg.conninfo.conninfo_to_dict(self.admin_dsn)
        info["dbname"] = dbname
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def _start_server() -> tuple[Server | None, object]:
    dsn = os.environ.get("PIMEM_TEST_DSN")
    if dsn:
        return Server(dsn), None
    bindir = find_bindir()
    if bindir is not None and (bindir / "initdb").exists():
        cluster = LocalCluster(bindir).init().start()
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
        if isinstance(handle, LocalCluster):
            handle.destroy()
        elif handle is not None:
            handle.stop()  # type: ignore[attr-defined]


_counter = itertools.count()


@pytest.fixture
def db_dsn(pg_server: Server) -> Iterator[str]:
    """A fresh database cloned from the template; dropped after the test."""
    name = f"t_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"create database {name} template {TEMPLATE}")
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
            admin.execute(f"drop database if exists {name} with (force)")


@pytest.fixture
def conn(db_dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit superuser connection to a fresh database."""
    with psycopg.connect(db_dsn, autocommit=True) as c:
        yield c
