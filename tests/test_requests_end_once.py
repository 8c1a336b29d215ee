"""A request ends once (issue 40, part 5): whatever reports race, a finished request keeps its
final status; the later call gets MB003 and changes nothing. Real concurrent connections: the
first call's transaction is open while the second is made, and commits once the second waits
on it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.test_manage_memory import wait_until_blocked

REQUEST = "select memory.upsert_request('ws1', %s, 'bot1', 'dm-alice', 0, 'alice', " \
          "'interactive', %s, 'fake', 'm', 1, 0, null)"
FINISH = "select memory.finish_request('ws1', %s, %s, null)"

Call = Callable[[psycopg.Connection], Any]


def upsert(request: str, status: str) -> Call:
    return lambda c: c.execute(REQUEST, (request, status)).fetchone()


def finish(request: str, status: str) -> Call:
    return lambda c: c.execute(FINISH, (request, status)).fetchone()


def state(conn: psycopg.Connection, request: str) -> tuple[Any, ...]:
    row = conn.execute("select status, finished_at, updated_at from memory_private.requests "
                       "where workspace_id = 'ws1' and request_id = %s", (request,)).fetchone()
    assert row is not None
    return tuple(row)


def due_rows(conn: psycopg.Connection) -> int:
    row = conn.execute("select count(*) from memory_private.maintenance_due "
                       "where workspace_id = 'ws1'").fetchone()
    assert row is not None
    return int(row[0])


def race(db_dsn: str, conn: psycopg.Connection, first: Call, second: Call
         ) -> tuple[Any, BaseException | None]:
    """``first`` in an open transaction, ``second`` on another connection until it waits on
    the first, then the first commits. Returns the first's answer and the second's error."""
    outcome: list[BaseException | None] = [None]

    def run_second(c: psycopg.Connection) -> None:
        try:
            second(c)
        except psycopg.Error as exc:
            outcome[0] = exc

    with psycopg.connect(db_dsn) as one, psycopg.connect(db_dsn, autocommit=True) as two:
        answer = first(one)
        thread = threading.Thread(target=run_second, args=(two,))
        thread.start()
        wait_until_blocked(conn, two.info.backend_pid)
        one.commit()
        thread.join(timeout=30)
        assert not thread.is_alive()
    return answer, outcome[0]


@pytest.fixture
def world(conn: psycopg.Connection) -> World:
    w = World(conn)
    w.basic("ws1")
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    return w


RACES = {
    "finish succeeded, then upsert failed": (finish("r1", "succeeded"), upsert("r1", "failed"),
                                             "succeeded"),
    "upsert failed, then finish succeeded": (upsert("r1", "failed"), finish("r1", "succeeded"),
                                             "failed"),
    "finish failed, then finish succeeded": (finish("r1", "failed"), finish("r1", "succeeded"),
                                             "failed"),
    "finish succeeded, then upsert running": (finish("r1", "succeeded"), upsert("r1", "running"),
                                              "succeeded"),
    "upsert succeeded, then upsert failed": (upsert("r1", "succeeded"), upsert("r1", "failed"),
                                             "succeeded"),
    "a new request reported succeeded and failed": (upsert("r2", "succeeded"),
                                                    upsert("r2", "failed"), "succeeded"),
}


@pytest.mark.parametrize("name", sorted(RACES))
def test_a_finished_request_keeps_its_final_status_under_any_race(
        conn: psycopg.Connection, db_dsn: str, world: World, name: str) -> None:
    first, second, final = RACES[name]
    request = "r2" if "new request" in name else "r1"
    _, error = race(db_dsn, conn, first, second)
    assert isinstance(error, psycopg.Error) and error.sqlstate == "MB003", error
    assert "already finished" in str(error)
    after = state(conn, request)
    assert after[0] == final and after[1] is not None
    rows = due_rows(conn)
    # the refused call changed nothing: a later identical report is 'unchanged'
    assert upsert(request, final)(conn) == ("unchanged",)
    assert state(conn, request) == after and due_rows(conn) == rows


def test_the_same_end_reported_twice_at_once_is_one_end(
        conn: psycopg.Connection, db_dsn: str, world: World) -> None:
    answer, error = race(db_dsn, conn, finish("r1", "succeeded"), finish("r1", "succeeded"))
    assert error is None and answer == ("updated",)
    assert state(conn, "r1")[0] == "succeeded"
