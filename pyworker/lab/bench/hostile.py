"""The worst cases of ``query_memories``: a scope a member filled to make a search expensive.

Fuzzy words (``measure``): a member who may add notes fills their scope with notes of distinct
words that all share one three-letter prefix, then asks ``query_memories`` for 32 more words of
that prefix, none of which a note holds exactly: the literal and word stages find nothing, and
the fuzzy stage (typo and partial-word matching, sql/48_search.sql) is left with every word of
the scope as a candidate. Before its work was bounded this took 24.8 s at 256 notes.

Every word (``measure_every_word``): the member fills the scope with notes whose every line
holds every word of a 32-word question, as many lines as a note holds, then asks that question:
the word stage ranks every note, every word on every line (issue 42: 85 ms before the lines a
word is on were bounded). The notes are written through the public API
(``memory.manage_memory`` remember), as that member would.
"""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg

from pyworker.lab.bench import data, db

WORKSPACE = "bench-hostile"
PREFIX = "zor"
NOTES = 256
QUERY_WORDS = 32
NOTE_BYTES = 3900     # under the 4,000-byte summary limit a note keeps whole
TARGET_MS = 50.0      # at 256 notes (issue 31; the every-word case: issue 42)
EVERY_WORD_LINE_WORDS = 32


def _word(rng: random.Random) -> str:
    return PREFIX + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))


def build(conn: psycopg.Connection, notes: int = NOTES, seed: int = 31,
          every_word: bool = False) -> tuple[str, str, str]:
    """The workspace with ``notes`` notes of distinct same-prefix words in alice's private
    scope (``every_word``: notes whose every line holds every word of the query, shuffled), and
    a running request to search from. Returns (workspace, request, query)."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh() -> str:
        while True:
            w = _word(rng)
            if w not in seen:
                seen.add(w)
                return w

    conn.execute("delete from memory_private.workspaces where workspace_id = %s", (WORKSPACE,))
    conn.execute("select memory.upsert_workspace(%s, 1, 1000, 0, 30)", (WORKSPACE,))
    conn.execute("select memory.upsert_member(%s, 'alice', 'member', true)", (WORKSPACE,))
    conn.execute("select memory.upsert_bot(%s, 'b1', 'b1-identity', true)", (WORKSPACE,))
    conn.execute("select memory.upsert_chat(%s, 'dm-alice', 'private', 'alice', true)",
                 (WORKSPACE,))
    request_sql = ("select memory.upsert_request(%s, %s, 'b1', 'dm-alice', 0, 'alice', "
                   "'interactive', 'running', 'fake', 'm', 1, 0, null)")
    asked = [fresh() for _ in range(EVERY_WORD_LINE_WORDS)]
    for i in range(notes):
        if every_word:
            lines: list[str] = []
            while len("\n".join(lines)) + len(" ".join(asked)) + 20 < NOTE_BYTES:
                lines.append(" ".join(rng.sample(asked, len(asked))))
            text = "Remember that\n" + "\n".join(lines)
        else:
            words: list[str] = []
            while len(" ".join(words)) + 20 < NOTE_BYTES:
                words.append(fresh())
            text = "Remember that " + " ".join(words)
        request, message = f"note-{i:03d}", f"note-{i:03d}-m"
        conn.execute(request_sql, (WORKSPACE, request))
        conn.execute("select memory.upsert_message(%s, %s, %s, 'user', 'alice', %s, true, null, "
                     "'{}')", (WORKSPACE, message, request, text))
        row = conn.execute("select memory.manage_memory(%s, %s, 'remember', %s::jsonb)",
                           (WORKSPACE, request, json.dumps({"action": "remember",
                                                             "sourceId": message}))).fetchone()
        assert row is not None and row[0].get("status") == "done", row
    conn.execute(request_sql, (WORKSPACE, "hostile-live"))
    query = (" ".join(asked) + "?" if every_word
             else " ".join(fresh() for _ in range(QUERY_WORDS)))
    return WORKSPACE, "hostile-live", query


def measure(conn: psycopg.Connection, n: int, notes: int = NOTES) -> dict[str, Any]:
    """The hostile query over a scope of ``notes`` such notes, beside the SELECT 1 floor."""
    if not db.has_function(conn, db.QUERY_SIGNATURE):
        return db.not_available("memory.query_memories is not in the schema yet")
    ws, request, query = build(conn, notes)
    data.settle(conn)  # as the bench's own data: a lived-in database's visibility map and stats
    section = db.measure_query(conn, [(ws, request)], n, {"query": query}, "hostile")
    if section.get("status") == "ok":
        section["scope_records"] = notes
        section["target_ms"] = TARGET_MS
    conn.execute("delete from memory_private.workspaces where workspace_id = %s", (WORKSPACE,))
    return section


def measure_every_word(conn: psycopg.Connection, n: int, notes: int = NOTES) -> dict[str, Any]:
    """A 32-word question over a scope of ``notes`` notes whose every line holds every word of
    it, beside the SELECT 1 floor."""
    if not db.has_function(conn, db.QUERY_SIGNATURE):
        return db.not_available("memory.query_memories is not in the schema yet")
    ws, request, query = build(conn, notes, every_word=True)
    data.settle(conn)
    section = db.measure_query(conn, [(ws, request)], n, {"query": query}, "every")
    if section.get("status") == "ok":
        section["scope_records"] = notes
        section["query_words"] = EVERY_WORD_LINE_WORDS
        section["target_ms"] = TARGET_MS
    conn.execute("delete from memory_private.workspaces where workspace_id = %s", (WORKSPACE,))
    return section
