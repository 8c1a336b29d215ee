"""``pimem eval --provenance``: what each record depends on, and what removing a message does.

Run after a conversation is ingested (:func:`pyworker.lab.locomo.ingest_conversation`), on the
records the real worker wrote. Everything is read through the API; the rules stay in the
database (``memory_private.record_reasons``/``invalid_records``, ``sweep_retention``). This
module only reads, removes messages inside transactions it rolls back, and counts.

- **Per record** (``memory.explain_record``): its sources (what it cites, what query_memories
  shows, 20 at most) and its dependencies by ``via`` (``cited``; ``shown``: a message of its batch
  the output does not cite; ``inherited``: a dependency of a memory shown with the batch).
  Whether the sources are exactly the ids the summary cites inline (``[id, ...]``, read back with ``memory.query_memories`` by id; a bracket
  that names no message of the conversation, such as a photo caption, is not a citation).
- **Per message** of the conversation: the records that declare a dependency on it (the rows
  explain_record lists), and the records that removing it actually invalidates: in a
  transaction that is rolled back, ``memory.remove_message``, then ``memory.record_status``
  (the validity rule for the scope's own user). The two must be the same set for every
  message; ``mismatches`` counts those that are not.
- **Two worked removals** (an undepended turn, and a depended one: the conversation's first
  message when records depend on it, else the turn most records depend on): in a
  rolled-back transaction, ``memory.remove_message``, ``memory.run_maintenance`` (the retention
  sweep deletes records that can never be valid again), then which records are left and what
  ``memory.recall`` of a new request shows.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psycopg
from rich.console import Console
from rich.markup import escape

from pyworker.db import Database
from pyworker.lab import locomo
from pyworker.terminal import emit, fitted_table

SHOWN_SOURCES = 20  # query_memories shows the first 20 sources of a record
VIAS = ("cited", "shown", "inherited")  # record_dependencies.via


def message_ids(conv: locomo.Conversation, variant: locomo.Variant) -> list[tuple[str, str]]:
    """Every message the ingestion reported, with its kind: ``turn`` (a dataset turn) or
    ``reply`` (the group variant's stand-in bot reply to a turn)."""
    out: list[tuple[str, str]] = []
    for turn in conv.turns:
        out.append((turn.message_id, "turn"))
        if variant == "group":
            out.append((f"{turn.message_id}/ack", "reply"))
    return out


def _stats(values: Sequence[int | float]) -> dict[str, float]:
    if not values:
        return {"mean": 0, "median": 0, "max": 0, "min": 0}
    return {"mean": round(statistics.mean(values), 2),
            "median": round(float(statistics.median(values)), 2),
            "min": min(values), "max": max(values)}


def _valid_ids(conn: psycopg.Connection[Any], workspace: str) -> tuple[set[int], set[int]]:
    """(every record, the valid ones) by memory.record_status."""
    rows = conn.execute("select record_id, valid from memory.record_status where workspace_id = %s",
                        (workspace,)).fetchall()
    return {int(r[0]) for r in rows}, {int(r[0]) for r in rows if r[1]}


def removal_effect(conn: psycopg.Connection[Any], workspace: str, message_id: str,
                   valid_before: set[int]) -> set[int]:
    """The records (valid before) that are invalid once the message is removed, in a
    transaction rolled back."""
    with conn.transaction(force_rollback=True):
        conn.execute("select memory.remove_message(%s, %s)", (workspace, message_id))
        _all, valid = _valid_ids(conn, workspace)
        return valid_before - valid


def worked_removal(conn: psycopg.Connection[Any], layout: locomo.Layout, message_id: str,
                   valid_before: set[int]) -> dict[str, Any]:
    """Remove one message, run maintenance, look: which records are gone, which are left and
    valid, what recall of a new request shows. Rolled back."""
    ws = layout.workspace
    with conn.transaction(force_rollback=True):
        conn.execute("select memory.remove_message(%s, %s)", (ws, message_id))
        invalid_at_once = sorted(valid_before - _valid_ids(conn, ws)[1])
        swept = conn.execute("select memory.run_maintenance(%s)", (ws,)).fetchone()
        left, valid = _valid_ids(conn, ws)
        rid = "eval-provenance"
        conn.execute("select memory.upsert_request(%s, %s, %s, %s, %s, %s, 'interactive', "
                     "'running', %s, %s, 1.0, 0.0)",
                     (ws, rid, locomo.BOT, layout.chat, layout.topic, layout.asker,
                      layout.model.provider, layout.model.id))
        conn.execute("select memory.upsert_message(%s, %s, %s, 'user', %s, %s, true)",
                     (ws, f"{rid}/question", rid, layout.asker, "What do you remember?"))
        recalled = conn.execute("select memory.recall(%s, %s)", (ws, rid)).fetchone()
        shown = sorted(int(r["id"]) for r in (recalled[0] if recalled else {}).get("records")
                       or [])
    return {"message_id": message_id,
            "invalid_at_once": invalid_at_once,
            "deleted_by_maintenance": sorted(valid_before - left),
            "left_valid": len(valid & valid_before),
            "maintenance": swept[0] if swept else None,
            "recall_shows": shown,
            "recall_shows_removed": sorted(set(shown) & set(invalid_at_once))}


def measure(db: Database, dsn: str, layout: locomo.Layout, conv: locomo.Conversation,
            cited: dict[int, list[str]]) -> dict[str, Any]:
    """The provenance section of one ingested conversation. ``cited``: each valid record's
    inline-cited ids (:func:`pyworker.lab.evaluate.record_sources` with the ``citations`` judge)."""
    began = time.monotonic()
    ws = layout.workspace
    explained = {rid: db.explain_record(ws, rid) for rid in sorted(cited)}
    sources = {rid: [str(s) for s in e.get("sources") or []] for rid, e in explained.items()}
    deps = {rid: {str(d["message_id"]): str(d["via"]) for d in e.get("dependencies") or []}
            for rid, e in explained.items()}
    via_rows: Counter[str] = Counter(v for d in deps.values() for v in d.values())
    via_records = {v: sum(1 for d in deps.values() if v in d.values()) for v in VIAS}

    messages = message_ids(conv, layout.variant)
    depended: dict[str, set[int]] = {m: set() for m, _ in messages}
    for rid, d in deps.items():
        for m in d:
            depended.setdefault(m, set()).add(rid)

    mismatches: list[dict[str, Any]] = []
    invalidated: dict[str, int] = {}
    invalidating: dict[str, list[int]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        _all, valid_before = _valid_ids(conn, ws)
        for m, _kind in messages:
            hit = removal_effect(conn, ws, m, valid_before)
            invalidated[m] = len(hit)
            if hit:
                invalidating[m] = sorted(hit)
            if hit != depended[m] & valid_before:
                mismatches.append({"message_id": m, "invalidated": sorted(hit),
                                   "depended_by": sorted(depended[m])})
        # An undepended turn, and a depended one: the first message when records depend on
        # it, else the turn the most records depend on.
        turns = [m for m, kind in messages if kind == "turn"]
        free = next((m for m in turns if not depended[m]), None)
        most = max(turns, key=lambda m: (len(depended[m]), -turns.index(m)), default=None)
        held = turns[0] if turns and depended[turns[0]] else most
        worked = [worked_removal(conn, layout, m, valid_before)
                  for m in (free, held) if m is not None and (m == free or depended[m])]
        for w in worked:
            w["expected"] = sorted(depended[w["message_id"]] & valid_before)
            w["as_expected"] = (w["invalid_at_once"] == w["deleted_by_maintenance"]
                                == w["expected"] and not w["recall_shows_removed"])

    by_kind: dict[str, dict[str, int]] = {}
    for m, kind in messages:
        k = by_kind.setdefault(kind, {"messages": 0, "undepended": 0})
        k["messages"] += 1
        k["undepended"] += invalidated[m] == 0
    counts = [invalidated[m] for m, _ in messages]
    # A bracket that holds no message id (a photo caption: "[shares a photo: ...]") is text.
    known = {m for m, _ in messages}
    sources_match = sum(1 for rid in sources if sources[rid] and set(sources[rid])
                        == set(cited.get(rid, ())) & known)
    return {
        "records": len(explained),
        "records_valid": len(valid_before),
        "dependencies_per_record": _stats([len(d) for d in deps.values()]),
        "sources_per_record": _stats([len(s) for s in sources.values()]),
        "sources_shown_per_record": _stats([min(len(s), SHOWN_SOURCES)
                                            for s in sources.values()]),
        "sources_are_cited_ids": sources_match,
        "dependencies_by_via": {v: via_rows.get(v, 0) for v in VIAS},
        "records_with_via": via_records,
        "messages": len(messages),
        "messages_by_kind": by_kind,
        "messages_undepended": sum(1 for c in counts if c == 0),
        "invalidated_by_removal": _stats(counts),
        "invalidated_histogram": {str(k): v for k, v in sorted(Counter(counts).items())},
        "invalidated_by_message": invalidating,
        "first_message": {"message_id": messages[0][0],
                          "invalidates": invalidated[messages[0][0]]} if messages else None,
        "mismatches": mismatches,
        "worked_removals": worked,
        "seconds": round(time.monotonic() - began, 2),
    }


def render(result: dict[str, Any], console: Console) -> None:
    """One row per conversation and variant."""
    runs = [r for r in result["runs"] if "provenance" in r]
    if not runs:
        return

    def mmm(s: dict[str, float]) -> str:
        return f"{s['mean']:g}/{s['median']:g}/{s['max']:g}"

    rows = []
    for r in runs:
        p = r["provenance"]
        first = p["first_message"] or {"invalidates": 0}
        ok = not p["mismatches"] and all(w["as_expected"] for w in p["worked_removals"])
        via = p["dependencies_by_via"]
        rows.append([
            f"{escape(r['conversation'])}\n{escape(r['variant'])}", str(p["records"]),
            (f"deps {mmm(p['dependencies_per_record'])}\n"
            f"sources {mmm(p['sources_per_record'])}\n"
            f"shown/inherited {via['shown']}/{via['inherited']}"),
            (f"{p['messages_undepended']} of {p['messages']} undepended\n"
            f"one removal invalidates {mmm(p['invalidated_by_removal'])}\n"
            f"the first: {first['invalidates']} of {p['records_valid']}"),
            "ok" if ok else f"{len(p['mismatches'])} mismatch(es)"])
    emit(console, fitted_table(
        f"pimem eval --provenance, {result['adapter']} adapter: dependencies and sources per "
        "record (mean/median/max), records one message's removal invalidates",
        ("run", "records", "per record", "messages", "rule check"), rows, right=(1,)))
