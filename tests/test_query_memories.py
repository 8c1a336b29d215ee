"""query_memories: browse and literal search, results and their sources, the citation set, usage
once per tool call id, and argument validation in the database (R4-R7, C9)."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.test_recall import ids, make_record, query, recall


def citations(conn: psycopg.Connection, ws: str, request: str) -> list[str]:
    return [r[0] for r in conn.execute("select message_id from memory.request_citations(%s, %s)",
                                       (ws, request))]


def usage(conn: psycopg.Connection, record_id: int) -> tuple[int, Any]:
    row = conn.execute("select coalesce(u.usage_count, 0), u.last_used_at "
                       "from memory_private.records r left join memory_private.record_usage u "
                       "using (workspace_id, record_id) where r.record_id = %s",
                       (record_id,)).fetchone()
    assert row is not None
    return int(row[0]), row[1]


@pytest.fixture
def w(conn: psycopg.Connection) -> World:
    world = World(conn)
    world.basic()
    world.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    return world


def test_browse_is_newest_first_and_at_most_twelve(conn: psycopg.Connection, w: World) -> None:
    made = []
    for i in range(15):
        u, _ = w.conversation("ws1", f"h{i}", chat="dm-alice", user="alice", user_text=f"n{i}")
        made.append(make_record(conn, "ws1", f"h{i}", [u], title=f"note {i}"))
    newest = list(reversed(made))
    assert ids(query(conn, "ws1", "live", "c1", {})) == newest[:12]
    assert ids(query(conn, "ws1", "live", "c2", {"limit": 3})) == newest[:3]
    assert ids(query(conn, "ws1", "live", "c3", {"limit": 12})) == newest[:12]
    assert ids(query(conn, "ws1", "live", "c4", {"id": made[0]})) == [made[0]]
    assert ids(query(conn, "ws1", "live", "c5", {"id": 999999})) == []


def test_search_is_literal_and_case_insensitive_in_english_and_chinese(
        conn: psycopg.Connection, w: World) -> None:
    texts = {"tea": ("Drinks", "Alice prefers GREEN Tea in the morning"),
             "zh": ("饮食偏好", "用户对花生过敏，请避免推荐含花生的食物"),
             "pct": ("Discount", "Use 100% of the budget_cap"),
             "other": ("Music", "likes jazz")}
    made = {}
    for key, (title, summary) in texts.items():
        u, _ = w.conversation("ws1", f"h-{key}", chat="dm-alice", user="alice", user_text=key)
        made[key] = make_record(conn, "ws1", f"h-{key}", [u], title=title, summary=summary)
    assert ids(query(conn, "ws1", "live", "q1", {"query": "green tea"})) == [made["tea"]]
    assert ids(query(conn, "ws1", "live", "q2", {"query": "DRINKS"})) == [made["tea"]]
    assert ids(query(conn, "ws1", "live", "q3", {"query": "花生过敏"})) == [made["zh"]]
    assert ids(query(conn, "ws1", "live", "q4", {"query": "饮食"})) == [made["zh"]]
    assert ids(query(conn, "ws1", "live", "q5", {"query": "100%"})) == [made["pct"]]
    # % and _ are not wildcards.
    assert ids(query(conn, "ws1", "live", "q6", {"query": "%"})) == [made["pct"]]
    assert ids(query(conn, "ws1", "live", "q7", {"query": "t_a"})) == []
    assert ids(query(conn, "ws1", "live", "q8", {"query": "coffee"})) == []
    answer = query(conn, "ws1", "live", "q9", {"query": "tea", "id": made["other"]})
    assert ids(answer) == [] and answer["mode"] == "search"


def test_a_result_has_its_fields_twenty_sources_and_an_overflow_marker(
        conn: psycopg.Connection, w: World) -> None:
    w.request("ws1", "long", chat="dm-alice", user="alice", thread="thread-9")
    for i in range(25):
        w.message("ws1", f"m{i:02d}", "long", "user" if i % 2 == 0 else "assistant",
                  "alice" if i % 2 == 0 else "bot1", f"part {i}")
        conn.execute("select memory_private.advance_clock('1 second')")
    sources = [f"m{i:02d}" for i in range(25)]
    r = make_record(conn, "ws1", "long", sources, title="long talk", summary="a long talk")
    [result] = query(conn, "ws1", "live", "c1", {})["records"]
    assert result["id"] == r and result["kind"] == "extracted"
    assert result["title"] == "long talk" and result["summary"] == "a long talk"
    assert result["speaker_ids"] == ["alice"] and result["thread_ids"] == ["thread-9"]
    assert result["source_ids"] == sources[:20]
    assert result["source_count"] == 25 and result["sources_overflow"] == 5
    assert result["created_at"] and result["last_used_at"] is None
    # Only the 20 shown join the citation set; all 25 stay tracked as dependencies.
    assert citations(conn, "ws1", "live") == sources[:20]
    assert conn.execute("select count(*) from memory_private.record_sources "
                        "where record_id = %s", (r,)).fetchone() == (25,)


def test_citations_hold_what_was_returned_and_only_while_it_may_be_cited(
        conn: psycopg.Connection, w: World) -> None:
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="jazz")
    make_record(conn, "ws1", "h1", [u1], summary="tea")
    make_record(conn, "ws1", "h2", [u2], summary="jazz")
    assert citations(conn, "ws1", "live") == []
    recall(conn, "ws1", "live")
    assert citations(conn, "ws1", "live") == [], "the index alone authorizes no citation"
    query(conn, "ws1", "live", "c1", {"query": "tea"})
    assert citations(conn, "ws1", "live") == [u1]
    query(conn, "ws1", "live", "c2", {})
    assert citations(conn, "ws1", "live") == sorted([u1, u2])
    w.message("ws1", u2, "h2", "user", "alice", "blues")  # edited: no longer citable
    assert citations(conn, "ws1", "live") == [u1]
    w.remove("ws1", u1)
    assert citations(conn, "ws1", "live") == []
    # Other requests have their own sets.
    w.request("ws1", "other", chat="dm-alice", user="alice", status="running")
    assert citations(conn, "ws1", "other") == []


def test_usage_counts_once_per_tool_call_and_a_replay_rereads_current_state(
        conn: psycopg.Connection, w: World) -> None:
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="jazz")
    r1 = make_record(conn, "ws1", "h1", [u1], summary="tea")
    r2 = make_record(conn, "ws1", "h2", [u2], summary="jazz")
    first = query(conn, "ws1", "live", "call-1", {})
    assert ids(first) == [r2, r1] and first["replayed"] is False
    assert usage(conn, r1)[0] == 1 and usage(conn, r2)[0] == 1
    used_at = usage(conn, r1)[1]
    assert used_at is not None

    conn.execute("select memory_private.advance_clock('1 hour')")
    replay = query(conn, "ws1", "live", "call-1", {})
    assert replay["replayed"] is True and ids(replay) == [r2, r1]
    assert usage(conn, r1) == (1, used_at), "a replay counts nothing"

    # The replay re-checks: a source edited since is not returned again.
    w.message("ws1", u2, "h2", "user", "alice", "blues")
    assert ids(query(conn, "ws1", "live", "call-1", {})) == [r1]
    assert usage(conn, r1) == (1, used_at)

    query(conn, "ws1", "live", "call-2", {})
    count, later = usage(conn, r1)
    assert count == 2 and later > used_at
    # The same call id in another request is another call.
    w.request("ws1", "live2", chat="dm-alice", user="alice", status="running")
    query(conn, "ws1", "live2", "call-1", {})
    assert usage(conn, r1)[0] == 3


def test_a_record_is_made_with_its_usage_row_and_counting_it_never_touches_the_record(
        conn: psycopg.Connection, w: World) -> None:
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    r1 = make_record(conn, "ws1", "h1", [u1], summary="tea")
    assert conn.execute("select usage_count, last_used_at from memory_private.record_usage "
                        "where record_id = %s", (r1,)).fetchone() == (0, None)
    assert usage(conn, r1) == (0, None)
    # A record's first use updates its usage row: no insert, so no foreign-key check locking
    # the record's row (a lock writes the record's page: its tuple's xmax, WAL).
    row_version = "select ctid, xmax from memory_private.records where record_id = %s"
    before = conn.execute(row_version, (r1,)).fetchone()
    assert ids(query(conn, "ws1", "live", "first", {})) == [r1]
    assert usage(conn, r1)[0] == 1
    assert conn.execute(row_version, (r1,)).fetchone() == before
    # A row someone removed is made again by the next count (the key checks its record), and
    # the records beside it that kept theirs are counted once, not again by the remaking.
    r2 = make_record(conn, "ws1", "h1", [u1], summary="more tea")
    conn.execute("delete from memory_private.record_usage where record_id = %s", (r1,))
    assert sorted(ids(query(conn, "ws1", "live", "second", {}))) == sorted([r1, r2])
    assert usage(conn, r1)[0] == 1 and usage(conn, r2)[0] == 1
    # Never used is count 0 and no date, and only that.
    for values in ("0, now()", "1, null", "-1, null"):
        with pytest.raises(psycopg.errors.CheckViolation), conn.transaction():
            conn.execute("update memory_private.record_usage set (usage_count, last_used_at) = "
                         f"({values}) where record_id = %s", (r1,))
    assert usage(conn, r1)[0] == 1


def test_a_call_id_reused_with_other_arguments_is_a_conflict(
        conn: psycopg.Connection, w: World) -> None:
    query(conn, "ws1", "live", "call-1", {"query": "tea"})
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws1", "live", "call-1", {"query": "jazz"})
    assert err.value.sqlstate == "MB003"
    # Key order does not make a different call.
    query(conn, "ws1", "live", "call-2", {"query": "tea", "limit": 2})
    row = conn.execute("""select memory.query_memories('ws1', 'live', 'call-2',
                          '{"limit": 2, "query": "tea"}')""").fetchone()
    assert row is not None and row[0]["replayed"] is True


BAD_ARGS: list[tuple[str, str]] = [
    ("unknown key", '{"q": "tea"}'),
    ("extra key", '{"query": "tea", "scope": "all"}'),
    ("query not a string", '{"query": 5}'),
    ("query an array", '{"query": ["tea"]}'),
    ("id a string", '{"id": "5"}'),
    ("id fractional", '{"id": 1.5}'),
    ("id zero", '{"id": 0}'),
    ("limit zero", '{"limit": 0}'),
    ("limit thirteen", '{"limit": 13}'),
    ("limit negative", '{"limit": -1}'),
    ("limit a string", '{"limit": "3"}'),
    ("limit boolean", '{"limit": true}'),
    ("args an array", '[]'),
    ("args a string", '"tea"'),
]


@pytest.mark.parametrize("args", [a for _, a in BAD_ARGS], ids=[n for n, _ in BAD_ARGS])
def test_bad_arguments_are_mb001_and_change_nothing(conn: psycopg.Connection, w: World,
                                                    args: str) -> None:
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    r = make_record(conn, "ws1", "h1", [u])
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.query_memories('ws1', 'live', 'c1', %s::jsonb)", (args,))
    assert err.value.sqlstate == "MB001", err.value
    assert conn.execute("select count(*) from memory_private.tool_calls").fetchone() == (0,)
    assert usage(conn, r)[0] == 0


def test_null_arguments_and_over_long_queries_are_refused(conn: psycopg.Connection,
                                                          w: World) -> None:
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.query_memories('ws1', 'live', 'c1', null)")
    assert err.value.sqlstate == "MB001"
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws1", "live", "c2", {"query": "x" * 1001})
    assert err.value.sqlstate == "MB004"
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws1", "live", "", {})
    assert err.value.sqlstate == "MB001"
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws1", "nope", "c3", {})
    assert err.value.sqlstate == "MB002"
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws-none", "live", "c3", {})
    assert err.value.sqlstate == "MB002"


def test_json_nulls_mean_absent_and_the_answer_round_trips(conn: psycopg.Connection,
                                                           w: World) -> None:
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    r = make_record(conn, "ws1", "h1", [u], title="茶", summary="喜欢绿茶 \"quoted\" \\ done")
    answer = query(conn, "ws1", "live", "c1", {"query": None, "id": None, "limit": None})
    assert ids(answer) == [r] and answer["mode"] == "browse"
    assert json.loads(json.dumps(answer))["records"][0]["summary"] == "喜欢绿茶 \"quoted\" \\ done"
