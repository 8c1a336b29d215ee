"""pyworker.client, the bot backends' client, against a real database: one method per backend
function, typed answers, MB errors as typed exceptions, and the tool-call dispatcher."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from pyworker import errors
from pyworker.client import (
    AsyncMemoryClient,
    ManageResult,
    MemoryClient,
    QueryResult,
    Recall,
    WorkspaceNode,
)
from pyworker.db import Database, DatabaseUnavailable
from tests.conftest import Server


@pytest.fixture
def memory(db_dsn: str) -> Iterator[MemoryClient]:
    with MemoryClient(db_dsn, max_size=2) as client:
        yield client


def tool_calls(conn: psycopg.Connection) -> int:
    row = conn.execute("select count(*) from memory_private.tool_calls").fetchone()
    assert row is not None
    return int(row[0])


def private_request(memory: MemoryClient, request: str = "r1",
                    text: str = "Please remember that I like green tea.") -> None:
    """Alice's private chat with the bot, and a running request with her message."""
    assert memory.upsert_workspace("acme", 1, "10.00") in ("inserted", "unchanged")
    memory.upsert_member("acme", "alice", "owner")
    memory.upsert_bot("acme", "helper", "tg:1")
    memory.upsert_chat("acme", "dm-alice", "private", "alice")
    memory.upsert_request("acme", request, bot_id="helper", chat_id="dm-alice", topic_id=0,
                          user_id="alice", kind="interactive", status="running",
                          model_provider="fake", model_id="m", budget_usd="0.50")
    memory.upsert_message("acme", f"{request}-u", request, "user", "alice", text)


def test_a_request_runs_through_the_client_with_typed_answers(memory: MemoryClient) -> None:
    private_request(memory)
    assert memory.schema_version() >= 1
    scope = memory.resolve_scope("acme", "r1")
    assert (scope.scope_kind, scope.chat_id, scope.user_id) == ("private", "dm-alice", "alice")
    assert memory.recall("acme", "r1") == Recall(mode="none")

    remembered = memory.call_tool("acme", "r1", "manage_memory",
                                  '{"action": "remember", "sourceId": "r1-u"}', "call_1")
    assert isinstance(remembered.answer, ManageResult)
    assert (remembered.answer.status, remembered.answer.code) == ("done", "remembered")
    assert json.loads(remembered.content)["memory_id"] == remembered.answer.memory_id

    found = memory.call_tool("acme", "r1", "query_memories", {"query": "green tea"}, "call_2")
    assert isinstance(found.answer, QueryResult) and found.error_code is None
    [record] = found.answer.records
    assert (record.id, record.kind, record.source_ids) == (
        remembered.answer.memory_id, "note", ["r1-u"])
    assert record.speaker_ids == ["alice"] and "green tea" in record.summary
    assert (record.speaker_count, record.speakers_overflow, record.threads_overflow) == (1, 0, 0)
    # The model gets the database's answer as it was, not the client's defaults.
    assert json.loads(found.content)["records"][0]["source_ids"] == ["r1-u"]
    assert "forgotten_ids" not in json.loads(remembered.content)

    again = memory.call_tool("acme", "r1", "query_memories", '{"query": "green tea"}', "call_2")
    assert isinstance(again.answer, QueryResult) and again.answer.replayed
    assert memory.request_citations("acme", "r1") == ["r1-u"]
    assert memory.answer_retention_boundary("acme", "r1") is None

    memory.upsert_message("acme", "r1-a", "r1", "assistant", "helper", "Noted: green tea.")
    assert memory.upsert_request(
        "acme", "r1", bot_id="helper", chat_id="dm-alice", topic_id=0, user_id="alice",
        kind="interactive", status="succeeded", model_provider="fake", model_id="m",
        budget_usd="0.50", spent_usd=Decimal("0.0012")) == "updated"
    assert memory.remove_message("acme", "r1-u") == "updated"
    assert memory.request_citations("acme", "r1") == [], "a removed source is not citable"
    assert memory.delete_workspace("acme")["workspace_id"] == "acme"


def test_database_errors_come_as_typed_exceptions(memory: MemoryClient) -> None:
    with pytest.raises(errors.NotFound) as unknown:
        memory.upsert_member("nowhere", "alice", "owner")
    assert unknown.value.code == "MB002" and unknown.value.hint
    private_request(memory)
    with pytest.raises(errors.InvalidArgument):
        memory.upsert_member("acme", "bob", "boss")  # type: ignore[arg-type]
    with pytest.raises(errors.Conflict):
        memory.upsert_chat("acme", "dm-alice", "group")
    with pytest.raises(errors.TooLarge):
        memory.upsert_message("acme", "m-big", "r1", "user", "alice", "x" * 64_001)
    with pytest.raises(errors.NotFound):
        memory.recall("acme", "no-such-request")


def test_call_tool_hands_argument_errors_back_to_the_model_and_changes_nothing(
        memory: MemoryClient, conn: psycopg.Connection) -> None:
    private_request(memory)
    cases = [
        ("query_memories", '{"query": "tea"', "invalid_json"),
        ("search_everything", "{}", "unknown_tool"),
        ("query_memories", '{"query": "tea", "where": "all"}', "MB001"),
        ("query_memories", "[1, 2]", "MB001"),
        ("query_memories", json.dumps({"query": "t" * 1001}), "MB004"),
        ("manage_memory", '{"action": "remember everything", "sourceId": "r1-u"}', "MB001"),
        ("manage_memory", '{"action": "forget", "sourceId": "r1-u"}', "MB001"),
    ]
    for i, (name, arguments, code) in enumerate(cases):
        result = memory.call_tool("acme", "r1", name, arguments, f"bad_{i}")
        assert (result.error_code, result.answer) == (code, None), (name, arguments)
        assert json.loads(result.content)["error"]["code"] == code
    assert tool_calls(conn) == 0

    first = memory.call_tool("acme", "r1", "query_memories", '{"query": "tea"}', "call_1")
    assert first.error_code is None
    reused = memory.call_tool("acme", "r1", "query_memories", '{"query": "milk"}', "call_1")
    assert reused.error_code == "MB003", "one tool call id, other arguments"
    assert tool_calls(conn) == 1


def test_call_tool_raises_what_the_backend_must_fix(memory: MemoryClient) -> None:
    private_request(memory)
    with pytest.raises(errors.NotFound):
        memory.call_tool("acme", "no-such-request", "query_memories", "{}", "call_1")
    memory.upsert_request("acme", "nightly", bot_id="helper", chat_id="dm-alice", topic_id=0,
                          user_id="alice", kind="scheduled", status="running",
                          model_provider="fake", model_id="m", budget_usd=1)
    with pytest.raises(errors.NoScope):
        memory.call_tool("acme", "nightly", "query_memories", "{}", "call_1")
    assert memory.recall("acme", "nightly").mode == "none"


def test_the_client_needs_only_the_memory_backend_role(
        pg_server: Server, db_dsn: str) -> None:
    role = f"t_backend_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"create role {role} login in role memory_backend")
    try:
        info = psycopg.conninfo.conninfo_to_dict(db_dsn)
        info["user"] = role
        dsn = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
        with MemoryClient(dsn, max_size=1) as memory:
            private_request(memory)
            result = memory.call_tool("acme", "r1", "manage_memory",
                                      '{"action": "remember", "sourceId": "r1-u"}', "call_1")
            assert isinstance(result.answer, ManageResult) and result.answer.status == "done"
            assert memory.recall("acme", "r1").mode in ("none", "directory")
            assert memory.request_citations("acme", "r1") == []
    finally:
        with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
            admin.execute(f"drop owned by {role}")
            admin.execute(f"drop role {role}")


def test_an_unreachable_database_is_database_unavailable() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with MemoryClient(f"postgresql://nobody@127.0.0.1:{port}/none", timeout=0.5) as memory, \
            pytest.raises(DatabaseUnavailable):
        memory.recall("acme", "r1")


def test_the_tool_definitions_are_the_ones_the_database_serves(
        memory: MemoryClient, conn: psycopg.Connection) -> None:
    served = conn.execute("select memory.tool_definitions()").fetchone()
    assert served is not None
    assert memory.tool_definitions() == served[0]
    assert [t["name"] for t in served[0]] == ["query_memories", "manage_memory"]


def test_the_client_has_a_method_for_every_backend_function(conn: psycopg.Connection) -> None:
    granted = {row[0] for row in conn.execute(
        "select p.proname from pg_proc p join pg_namespace n on n.oid = p.pronamespace "
        "where n.nspname = 'memory' and has_function_privilege('memory_backend', p.oid, "
        "'execute')")}
    assert len(granted) >= 17
    assert {name for name in granted if not callable(getattr(MemoryClient, name, None))} == set()


def finished_conversation(memory: MemoryClient) -> None:
    """Alice's request r1 with her message and the bot's answer, finished, in a workspace whose
    idle window is 0 minutes: the worker extracts it at its next pass."""
    private_request(memory, text="Please always answer me in German.")
    assert memory.upsert_workspace("acme", 1, "10.00", idle_minutes=0) == "updated"
    memory.upsert_message("acme", "r1-a", "r1", "assistant", "helper",
                          "Understood: from now on I answer you in German.")
    assert memory.finish_request("acme", "r1") == "updated"


def run_worker_once(dsn: str) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "pimem"), "worker", "--model", "offline", "--once"],
        env={**os.environ, "PIMEM_DSN": dsn}, capture_output=True, text=True, timeout=300,
        check=False)
    assert done.returncode == 0, done.stderr


def test_finish_request_ends_a_request_with_its_spend_and_no_other_field(
        memory: MemoryClient, conn: psycopg.Connection) -> None:
    private_request(memory)
    assert memory.finish_request("acme", "r1", spent_usd="0.0125") == "updated"
    assert memory.finish_request("acme", "r1") == "unchanged"
    with pytest.raises(errors.Conflict):
        memory.finish_request("acme", "r1", "failed")
    with pytest.raises(errors.InvalidArgument):
        memory.finish_request("acme", "r1", "done")  # type: ignore[arg-type]
    with pytest.raises(errors.NotFound):
        memory.finish_request("acme", "r404")
    row = conn.execute("select status, spent_usd, model_id from memory_private.requests "
                       "where workspace_id = 'acme' and request_id = 'r1'").fetchone()
    assert row == ("succeeded", Decimal("0.0125"), "m")


def test_search_results_carry_their_rank_and_how_they_matched(
        memory: MemoryClient, db_dsn: str) -> None:
    finished_conversation(memory)
    memory.upsert_request("acme", "r2", bot_id="helper", chat_id="dm-alice", topic_id=0,
                          user_id="alice", kind="interactive", status="running",
                          model_provider="fake", model_id="m", budget_usd="0.50")
    memory.upsert_message("acme", "r2-u", "r2", "user", "alice",
                          "Remember that my tea is green tea.")
    memory.manage_memory("acme", "r2", "call_0", {"action": "remember", "sourceId": "r2-u"})
    run_worker_once(db_dsn)
    memory.upsert_request("acme", "r3", bot_id="helper", chat_id="dm-alice", topic_id=0,
                          user_id="alice", kind="interactive", status="running",
                          model_provider="fake", model_id="m", budget_usd="0.50")

    found = memory.query_memories("acme", "r3", "call_1", {"query": "answer german tea"})
    assert [r.rank for r in found.records] == list(range(1, found.count + 1))
    assert found.count >= 1 and {r.match for r in found.records} <= {"literal", "words", "fuzzy"}
    assert found.records[0].match == "words" and "German" in found.records[0].summary, \
        "two of the query's words are in the German record, one in the tea note"
    browsed = memory.query_memories("acme", "r3", "call_2", {})
    assert [r.rank for r in browsed.records] == list(range(1, browsed.count + 1))
    assert {r.match for r in browsed.records} == {None}
    assert browsed.count == 2


def test_the_tools_come_in_the_shapes_of_openai_and_anthropic(memory: MemoryClient) -> None:
    served = memory.tool_definitions()
    openai = memory.tool_definitions("openai")
    assert openai == [{"type": "function", "function": d} for d in served]
    assert [t["function"]["name"] for t in openai] == ["query_memories", "manage_memory"]
    anthropic = memory.tool_definitions("anthropic")
    assert [set(t) for t in anthropic] == [{"name", "description", "input_schema"}] * 2
    assert [t["input_schema"] for t in anthropic] == [d["parameters"] for d in served]
    assert [t["name"] for t in anthropic] == [d["name"] for d in served]
    with pytest.raises(ValueError, match="shapes are database, openai, anthropic"):
        memory.tool_definitions("gemini")  # type: ignore[arg-type]

    printed = subprocess.run(
        [sys.executable, "-m", "pyworker.tools", "--dsn", memory.pool.conninfo,
         "--shape", "anthropic"], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(printed.stdout) == anthropic


def test_the_async_client_has_the_same_methods_and_the_same_answers(
        memory: MemoryClient, db_dsn: str) -> None:
    public = {name for name in dir(MemoryClient) if not name.startswith("_")}
    assert public - {"close", "pool"} <= set(dir(AsyncMemoryClient))

    async def tour() -> None:
        async with AsyncMemoryClient(db_dsn, max_size=2) as amemory:
            assert await amemory.upsert_workspace("acme", 1, "10.00", idle_minutes=0) \
                == "inserted"
            await amemory.upsert_member("acme", "alice", "owner")
            await amemory.upsert_bot("acme", "helper", "tg:1")
            await amemory.upsert_chat("acme", "dm-alice", "private", "alice")
            for request in ("r1", "r2"):
                await amemory.upsert_request(
                    "acme", request, bot_id="helper", chat_id="dm-alice", topic_id=0,
                    user_id="alice", kind="interactive", status="running",
                    model_provider="fake", model_id="m", budget_usd="0.50")
            await amemory.upsert_message("acme", "r1-u", "r1", "user", "alice",
                                         "Please always answer me in German.")
            await amemory.upsert_message("acme", "r1-a", "r1", "assistant", "helper",
                                         "Understood: from now on I answer you in German.")
            assert await amemory.finish_request("acme", "r1") == "updated"
            assert await amemory.recall("acme", "r2") == Recall(mode="none")
            await asyncio.to_thread(run_worker_once, db_dsn)
            await amemory.upsert_request(
                "acme", "r3", bot_id="helper", chat_id="dm-alice", topic_id=0,
                user_id="alice", kind="interactive", status="running",
                model_provider="fake", model_id="m", budget_usd="0.50")
            recall = await amemory.recall("acme", "r3")
            assert recall.mode == "index" and recall.index and "German" in recall.index
            assert recall == memory.recall("acme", "r3"), "one answer, whichever client asks"
            assert await amemory.recall("acme", "r2") == Recall(mode="none"), \
                "r2's recall was frozen at its first call"

            found = await amemory.call_tool("acme", "r3", "query_memories",
                                            '{"query": "German"}', "call_1")
            assert isinstance(found.answer, QueryResult) and found.answer.records[0].rank == 1
            # The user's preference, and the bot's answer (what each speaker stated).
            assert found.answer.records[0].source_ids == ["r1-u", "r1-a"]
            bad = await amemory.call_tool("acme", "r3", "query_memories", '{"query": ',
                                          "call_2")
            assert bad.error_code == "invalid_json" and bad.answer is None
            refused = await amemory.call_tool("acme", "r3", "query_memories",
                                              '{"where": "all"}', "call_3")
            assert refused.error_code == "MB001"
            with pytest.raises(errors.NotFound):
                await amemory.recall("acme", "no-such-request")
            assert sorted(await amemory.request_citations("acme", "r3")) == ["r1-a", "r1-u"]
            assert (await amemory.resolve_scope("acme", "r3")).scope_kind == "private"
            assert await amemory.tool_definitions("openai") == memory.tool_definitions("openai")

    asyncio.run(tour())


def test_the_async_client_says_when_the_database_is_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def ask() -> None:
        async with AsyncMemoryClient(f"postgresql://nobody@127.0.0.1:{port}/none",
                                     timeout=0.5) as amemory:
            await amemory.recall("acme", "r1")

    with pytest.raises(DatabaseUnavailable):
        asyncio.run(ask())


@pytest.mark.no_citus("one server: on the cluster the client routes (tests/test_citus.py)")
def test_on_one_server_every_call_goes_to_the_dsn_given(memory: MemoryClient,
                                                         db_dsn: str) -> None:
    private_request(memory)
    assert memory.recall("acme", "r1").mode in ("none", "directory", "index")
    # One question, the first call's: the server holds every workspace, nothing to route.
    assert memory.routes.routing is False and memory._node_pools == {}
    assert memory.workspace_node("acme") == WorkspaceNode(host=None, port=None, here=True)
    db = Database(db_dsn)
    try:
        assert db.claim_nodes() == [None] and db.routes.routing is False
        assert db.claim_job("w1") is None  # nothing due: claimed as before, on the DSN given
        assert db._conns.keys() == {None}
    finally:
        db.close()
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("select * from memory.workspace_nodes()").fetchall() == [
            (None, None, True)]


@pytest.mark.no_citus("one server: on the cluster the client routes (tests/test_citus.py)")
def test_the_async_client_on_one_server_routes_nothing(db_dsn: str) -> None:
    async def calls() -> tuple[bool | None, int]:
        async with AsyncMemoryClient(db_dsn) as memory:
            await memory.upsert_workspace("solo", 1, "10")
            return memory.routes.routing, len(memory._node_pools)

    assert asyncio.run(calls()) == (False, 0)


def test_routing_off_or_a_pool_of_ones_own_sends_everything_to_the_dsn_given(
        db_dsn: str) -> None:
    with MemoryClient(db_dsn, route=False) as memory:
        assert memory.upsert_workspace("plain", 1, "10") == "inserted"
        assert memory.routes.routing is False and memory._node_pools == {}
    with ConnectionPool(db_dsn, kwargs={"autocommit": True}, min_size=1) as pool, \
            MemoryClient(pool=pool) as memory:
        assert memory.upsert_workspace("plain", 1, "10") == "unchanged"
        assert memory.routes.routing is False and memory._node_pools == {}
