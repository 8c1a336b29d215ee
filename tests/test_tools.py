"""The tool definitions come from the database (``memory.tool_definitions()``), and every limit
their JSON schemas state is one ``query_memories`` / ``manage_memory`` enforce, at exactly that
boundary: an argument at the limit is taken, one past it is refused with MB001/MB004."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World

# The widest character: 4 UTF-8 bytes. A maxLength counts characters and the database counts
# bytes, so a string of maxLength of these is the longest the database must still take.
WIDE = "\U0001f375"  # teacup without handle
assert len(WIDE.encode("utf-8")) == 4

# The keywords the boundary test knows how to test; a schema using any other fails it, so that
# a new limit cannot be added without being pinned to the database.
KNOWN = {"type", "description", "properties", "required", "additionalProperties", "enum",
         "minimum", "maximum", "minLength", "maxLength"}

# Arguments valid for each tool, and those in which one argument means something (memoryId is
# for forget only, title for remember only).
VALID = {"query_memories": {}, "manage_memory": {"action": "remember", "sourceId": "r1-u"}}
CONTEXT = {("manage_memory", "memoryId"): {"action": "forget", "sourceId": "r1-u"},
           ("manage_memory", "action"): {"sourceId": "r1-u"}}


def definitions(conn: psycopg.Connection) -> list[dict[str, Any]]:
    row = conn.execute("select memory.tool_definitions()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def test_the_database_serves_both_tools_with_closed_schemas(conn: psycopg.Connection) -> None:
    tools = definitions(conn)
    assert [t["name"] for t in tools] == ["query_memories", "manage_memory"]
    assert all(list(t) == ["name", "description", "parameters"] for t in tools)
    query, manage = (t["parameters"] for t in tools)
    assert query["type"] == "object" and query["additionalProperties"] is False
    assert list(query["properties"]) == ["query", "id", "limit"] and "required" not in query
    assert query["properties"]["limit"] == {**query["properties"]["limit"], "type": "integer",
                                            "minimum": 1, "maximum": 12}
    assert manage["type"] == "object" and manage["additionalProperties"] is False
    assert list(manage["properties"]) == ["action", "sourceId", "memoryId", "title"]
    assert manage["required"] == ["action", "sourceId"]
    assert manage["properties"]["action"]["enum"] == ["remember", "forget", "enable-memory",
                                                      "disable-memory"]
    assert "approve nothing" in tools[0]["description"]
    assert "directly asks" in tools[1]["description"]


def test_each_character_limit_is_the_byte_limit_in_four_byte_characters_and_says_so(
        conn: psycopg.Connection) -> None:
    limits = {(t["name"], name): prop for t in definitions(conn)
              for name, prop in t["parameters"]["properties"].items() if "maxLength" in prop}
    assert {key: prop["maxLength"] for key, prop in limits.items()} == {
        ("query_memories", "query"): 250, ("manage_memory", "sourceId"): 50,
        ("manage_memory", "title"): 75}
    for prop in limits.values():
        assert (f"At most {prop['maxLength'] * 4} UTF-8 bytes, so at most {prop['maxLength']} "
                "characters") in prop["description"], prop["description"]


def limit_cases(tool: str, schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(what, arguments, taken) for every limit the schema states: at it, and just past it."""
    assert set(schema) <= KNOWN, f"{tool}: a keyword this test does not pin: {set(schema)}"
    base = VALID[tool]
    cases: list[tuple[str, dict[str, Any], bool]] = [
        ("the valid arguments", base, True),
        ("an argument the schema does not list", {**base, "unlisted": 1}, False)]
    assert schema["additionalProperties"] is False
    for name in schema.get("required", []):
        cases.append((f"without the required {name}",
                      {k: v for k, v in base.items() if k != name}, False))
    for name, prop in schema["properties"].items():
        assert set(prop) <= KNOWN, f"{tool}.{name}: a keyword this test does not pin: {prop}"
        ctx = {k: v for k, v in CONTEXT.get((tool, name), base).items() if k != name}

        def case(what: str, value: Any, taken: bool, name: str = name,
                 ctx: dict[str, Any] = ctx) -> None:
            cases.append((f"{name} {what}", {**ctx, name: value}, taken))

        if prop["type"] == "string":
            case("as a number", 7, False)
        else:
            assert prop["type"] == "integer"
            case("as a fraction", prop["minimum"] + 0.5, False)
            case("as a string", str(prop["minimum"]), False)
        if "maxLength" in prop:
            n = prop["maxLength"]
            case(f"at maxLength {n} in 4-byte characters", WIDE * n, True)
            case(f"one 4-byte character past maxLength {n}", WIDE * (n + 1), False)
        if "minLength" in prop:
            n = prop["minLength"]
            case(f"at minLength {n}", "x" * n, True)
            case(f"one character under minLength {n}", "x" * (n - 1), False)
        if "minimum" in prop:
            case(f"at minimum {prop['minimum']}", prop["minimum"], True)
            case(f"under minimum {prop['minimum']}", prop["minimum"] - 1, False)
        if "maximum" in prop:
            case(f"at maximum {prop['maximum']}", prop["maximum"], True)
            case(f"over maximum {prop['maximum']}", prop["maximum"] + 1, False)
        if "enum" in prop:
            for value in prop["enum"]:
                extra = {"memoryId": 1} if (tool, value) == ("manage_memory", "forget") else {}
                cases.append((f"{name} {value}", {**ctx, **extra, name: value}, True))
            case("outside the enum", prop["enum"][0] + "x", False)
    return cases


def call(conn: psycopg.Connection, tool: str, args: dict[str, Any]) -> str | None:
    """The MB code the tool's function refuses the arguments with, or None if it took them."""
    try:
        conn.execute(f"select memory.{tool}('ws1', 'r1', %s, %s)",
                     (f"call-{uuid.uuid4().hex}", Jsonb(args)))
    except psycopg.Error as err:
        return err.sqlstate
    return None


def test_every_limit_the_schemas_state_is_the_databases_own_boundary(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like tea")
    tried = 0
    for tool in definitions(conn):
        for what, args, taken in limit_cases(tool["name"], tool["parameters"]):
            code = call(conn, tool["name"], args)
            if taken:
                assert code is None, f"{tool['name']}: {what} was refused with {code}"
            else:
                assert code in ("MB001", "MB004"), f"{tool['name']}: {what} gave {code}"
            tried += 1
    assert tried >= 40


def test_the_backend_role_reads_the_definitions_and_python_prints_them(
        conn: psycopg.Connection, db_dsn: str) -> None:
    printed = subprocess.run([sys.executable, "-m", "pyworker.tools", "--dsn", db_dsn],
                             capture_output=True, text=True, check=True).stdout
    assert json.loads(printed) == definitions(conn)
    conn.execute("create role pimem_test_tools login in role memory_backend")
    try:
        conn.execute("set role pimem_test_tools")
        assert [t["name"] for t in definitions(conn)] == ["query_memories", "manage_memory"]
    finally:
        conn.execute("reset role")
        conn.execute("drop role pimem_test_tools")


def test_printing_the_tools_without_a_database_says_so_and_fails() -> None:
    missing = subprocess.run([sys.executable, "-m", "pyworker.tools"], check=False,
                             capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "--dsn" in missing.stderr
    down = subprocess.run([sys.executable, "-m", "pyworker.tools", "--dsn",
                           "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"],
                          check=False, capture_output=True, text=True)
    assert down.returncode == 1 and down.stdout == "" and "pyworker.tools:" in down.stderr


@pytest.mark.parametrize("tool", ["query_memories", "manage_memory"])
def test_json_null_for_an_optional_argument_is_taken_though_the_schema_does_not_offer_it(
        conn: psycopg.Connection, tool: str) -> None:
    """The schemas offer plain types (omitting an argument is how a model says "none"); the
    database still takes an explicit null, so a model that sends one is not refused."""
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like tea")
    [schema] = [t["parameters"] for t in definitions(conn) if t["name"] == tool]
    optional = [n for n in schema["properties"] if n not in schema.get("required", [])]
    assert optional
    for name in optional:
        assert call(conn, tool, {**VALID[tool], name: None}) is None, name
