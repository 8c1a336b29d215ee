"""The tools' argument models and JSON schemas agree with what the database accepts."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, ValidationError

from pyworker.tools import ManageMemoryArgs, QueryMemoriesArgs, tool_definitions
from tests.factory import World


def test_both_tools_are_defined_with_closed_schemas() -> None:
    tools = {t["name"]: t for t in tool_definitions()}
    assert set(tools) == {"query_memories", "manage_memory"}
    query = tools["query_memories"]["parameters"]
    assert query["type"] == "object" and query["additionalProperties"] is False
    assert set(query["properties"]) == {"query", "id", "limit"} and "required" not in query
    assert query["properties"]["limit"] == {**query["properties"]["limit"], "type": "integer",
                                            "minimum": 1, "maximum": 12}
    manage = tools["manage_memory"]["parameters"]
    assert manage["required"] == ["action", "sourceId"]
    assert manage["properties"]["action"]["enum"] == ["remember", "forget", "enable-memory",
                                                      "disable-memory"]
    assert "anyOf" not in json.dumps(tools), "optional fields are plain types for models"
    assert "approve nothing" in tools["query_memories"]["description"]


# (model, args, valid) - the pydantic model and the database must agree on each.
CASES: list[tuple[type[BaseModel], dict[str, Any], bool]] = [
    (QueryMemoriesArgs, {}, True),
    (QueryMemoriesArgs, {"query": "绿茶", "limit": 3}, True),
    (QueryMemoriesArgs, {"id": 7}, True),
    (QueryMemoriesArgs, {"query": None}, True),
    (QueryMemoriesArgs, {"limit": 13}, False),
    (QueryMemoriesArgs, {"limit": 0}, False),
    (QueryMemoriesArgs, {"q": "tea"}, False),
    (QueryMemoriesArgs, {"query": ["tea"]}, False),
    (ManageMemoryArgs, {"action": "remember", "sourceId": "r1-u"}, True),
    (ManageMemoryArgs, {"action": "remember", "sourceId": "r1-u", "title": "Tea"}, True),
    (ManageMemoryArgs, {"action": "disable-memory", "sourceId": "r1-u"}, True),
    (ManageMemoryArgs, {"action": "save", "sourceId": "r1-u"}, False),
    (ManageMemoryArgs, {"action": "remember"}, False),
    (ManageMemoryArgs, {"action": "remember", "sourceId": ""}, False),
    (ManageMemoryArgs, {"action": "remember", "sourceId": "r1-u", "extra": 1}, False),
]


@pytest.mark.parametrize("model,args,valid", CASES,
                         ids=[f"{m.__name__}-{json.dumps(a)}" for m, a, _ in CASES])
def test_the_model_and_the_database_agree(conn: psycopg.Connection, model: type[BaseModel],
                                          args: dict[str, Any], valid: bool) -> None:
    try:
        model.model_validate_json(json.dumps(args), strict=True)
        model_ok = True
    except ValidationError:
        model_ok = False
    assert model_ok is valid

    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like tea")
    function = "query_memories" if model is QueryMemoriesArgs else "manage_memory"
    try:
        conn.execute(f"select memory.{function}('ws1', 'r1', 'call', %s::jsonb)",
                     (json.dumps(args),))
        db_ok = True
    except psycopg.Error as err:
        assert err.sqlstate in ("MB001", "MB004"), err
        db_ok = False
    assert db_ok is valid
