"""The benchmark's synthetic dataset: W workspaces x 256 records with realistic sources.

Each workspace looks like a small team that has used its bot for a few weeks:
- three active members (``u1`` owner, ``u2``, ``u3``), one bot ``b1``, a private chat ``dm-u1``
  and a linked group ``grp`` (topic 0);
- 128 finished interactive conversations (a user message and the bot's reply each, 200-600
  bytes of chat text, real SHA-256 content hashes) in the workspace's *full scope*: the private
  scope of ``u1`` in even workspaces, the shared scope of ``grp`` topic 0 in odd ones;
- that scope holds 256 records (the per-workspace ceiling, T5), each depending on real messages
  at their real hashes: most on one user/assistant pair, every 16th on 24 messages (more than
  the 20 source ids query_memories shows), every 8th on a repository the members may read;
- the scope's consolidated index names the 12 newest records.

The pipeline writes records through ``memory.commit_job``; at 256k records that is far too slow
for a benchmark set-up, so the set-up writes the tables directly with COPY, as a superuser, with
foreign-key triggers off while it loads (as pg_restore does) and a consistency check afterwards.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

RECORDS_PER_WORKSPACE = 256
CONVERSATIONS_PER_WORKSPACE = 128
WIDE_RECORD_EVERY = 16      # every 16th record cites 24 messages
WIDE_RECORD_SOURCES = 24
BATCH_CONVERSATIONS = 20    # a record rests on its batch: 20 conversations, 40 messages
REPO_RECORD_EVERY = 8       # every 8th record drew on repository "repo-docs"
SEARCH_TERM = "kubernetes"  # appears in every 16th record (16 of 256): a literal search hit
# A question passed whole, as a model would: no literal match, found by its words (ranked).
QUESTION = "What did we decide about the billing export and its open items?"
USERS = ("u1", "u2", "u3")

_TOPICS = [
    "the release checklist", "the billing export", "our onboarding guide", "the cluster upgrade",
    "the quarterly report", "the API rate limits", "the customer survey",
    "the database migration", "the on-call rota", "the design review", "the mobile app",
    "the pricing page", "the support macros", "the data retention policy", "the CI pipeline",
    "the marketing calendar", "the incident postmortem", "the hiring plan",
]
_USER_LINES = [
    "Can you summarise where we are with {t}? I need it before the meeting on Thursday.",
    "Please remember that I prefer short answers with bullet points when we talk about {t}.",
    "Actually, correction: the deadline for {t} moved to the end of next month, not this one.",
    "We decided to keep the old behaviour for {t} until the customers have been told.",
    "I still have not finished the draft for {t}; remind me what is left to do.",
    "Could you compare the two proposals for {t} and say which one is cheaper to run?",
    "The numbers for {t} look wrong to me, the totals do not match last week's export.",
    "Let's not change {t} this sprint. Maria thinks it needs another round of review first.",
]
_BOT_LINES = [
    ("Here is where {t} stands: the first two steps are done, the review is scheduled and the "
     "rollout waits for sign-off from the owners."),
    "Noted. For {t} I will keep answers short and use bullet points from now on.",
    ("Understood, the new deadline for {t} is the end of next month. I updated the plan "
     "accordingly and flagged the two tasks that depended on the old date."),
    ("The remaining work on {t}: finish the draft, collect feedback from two reviewers, and "
     "publish the summary to the team channel."),
    ("Proposal A for {t} costs about 30% less per month but needs more manual work; proposal B "
     "is simpler to operate. The team has not decided yet."),
    ("I checked {t}: the difference comes from refunds booked after the export ran. Re-running "
     "the export fixes the totals."),
]
_FILLER = [
    "This was discussed in the weekly sync.", "Two people asked about it in the group.",
    "Nothing has been deployed yet.", "The owner confirmed it by message.",
    "It is still an open question whether this applies to all regions.",
    "The previous attempt failed because of a missing permission.",
    "A follow-up is planned for next week.", "The estimate is rough and may change.",
]


def content_hash(text: str) -> str:
    """The same hash ``memory_private.content_hash`` computes: hex SHA-256 of the UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def workspace_id(index: int) -> str:
    return f"bench-{index:05d}"


def scope_kind(index: int) -> str:
    return "private" if index % 2 == 0 else "shared"


def chat_of(index: int) -> str:
    return "dm-u1" if scope_kind(index) == "private" else "grp"


def user_of(index: int, k: int) -> str:
    """The user of conversation k: always u1 in a private chat, rotating in the group."""
    return "u1" if scope_kind(index) == "private" else USERS[k % len(USERS)]


def chat_text(rng: random.Random, lines: Sequence[str], lo: int, hi: int) -> str:
    topic = rng.choice(_TOPICS)
    text = rng.choice(lines).format(t=topic)
    while len(text) < lo:
        text += " " + rng.choice(_FILLER)
    return text[:hi]


@dataclass
class Copy:
    table: str
    columns: tuple[str, ...]
    rows: list[tuple[object, ...]]


def _copy(conn: psycopg.Connection, data: Copy) -> None:
    cols = ", ".join(data.columns)
    with conn.cursor().copy(f"copy memory_private.{data.table} ({cols}) from stdin") as cp:
        for row in data.rows:
            cp.write_row(row)


def _ids(conn: psycopg.Connection, table: str, column: str, n: int) -> list[int]:
    """n fresh values of an identity column's sequence, so later inserts never collide."""
    rows = conn.execute(
        "select nextval(pg_get_serial_sequence(%s, %s)) from generate_series(1, %s)",
        (f"memory_private.{table}", column, n)).fetchall()
    return [int(r[0]) for r in rows]


def build_workspaces(conn: psycopg.Connection, indexes: Iterable[int], *, now: datetime,
                     seed: int = 7) -> int:
    """Writes the given workspaces in one transaction; returns how many records it wrote."""
    indexes = list(indexes)
    if not indexes:
        return 0
    tables: dict[str, Copy] = {
        "workspaces": Copy("workspaces", ("workspace_id", "config_version", "budget_usd",
                                          "spent_usd", "created_at", "updated_at"), []),
        "members": Copy("members", ("workspace_id", "user_id", "role", "active", "updated_at"),
                        []),
        "bots": Copy("bots", ("workspace_id", "bot_id", "identity", "active", "updated_at"), []),
        "chats": Copy("chats", ("workspace_id", "chat_id", "kind", "private_user_id", "linked",
                                "updated_at"), []),
        "topics": Copy("topics", ("workspace_id", "chat_id", "topic_id"), []),
        "repository_grants": Copy("repository_grants", ("workspace_id", "user_id",
                                                        "repository_id", "granted_at"), []),
        "requests": Copy("requests", ("workspace_id", "request_id", "bot_id", "chat_id",
                                      "topic_id", "user_id", "kind", "status", "model_provider",
                                      "model_id", "budget_usd", "spent_usd", "thread_id",
                                      "created_at", "updated_at", "finished_at"), []),
        "messages": Copy("messages", ("workspace_id", "message_id", "request_id", "role",
                                      "speaker_id", "body", "content_hash", "directed",
                                      "repositories", "created_at"), []),
        "scopes": Copy("scopes", ("workspace_id", "scope_id", "kind", "bot_id", "chat_id",
                                  "user_id", "topic_id", "created_at"), []),
        "scope_indexes": Copy("scope_indexes", ("workspace_id", "scope_id", "index_text",
                                                "record_ids", "candidate_ids", "bot_identity",
                                                "repositories", "built_at"), []),
        "records": Copy("records", ("workspace_id", "record_id", "scope_id", "kind", "title",
                                    "summary", "speaker_ids", "thread_ids", "repositories",
                                    "bot_identity", "origin_request_id", "created_at",
                                    "dependency_ids", "dependency_hashes", "source_ids"), []),
        "record_dependencies": Copy("record_dependencies", ("workspace_id", "record_id",
                                                            "message_id", "content_hash", "via",
                                                            "position"), []),
    }
    scope_ids = _ids(conn, "scopes", "scope_id", len(indexes))
    record_ids = _ids(conn, "records", "record_id", len(indexes) * RECORDS_PER_WORKSPACE)
    start = now - timedelta(days=20)
    for n, index in enumerate(indexes):
        rng = random.Random(seed * 1_000_003 + index)
        ws = workspace_id(index)
        kind = scope_kind(index)
        chat = chat_of(index)
        t = tables
        t["workspaces"].rows.append((ws, 1, 1000, 0, start, start))
        for i, user in enumerate(USERS):
            t["members"].rows.append((ws, user, "owner" if i == 0 else "member", True, start))
            t["repository_grants"].rows.append((ws, user, "repo-docs", start))
        t["bots"].rows.append((ws, "b1", "b1-identity", True, start))
        t["chats"].rows.append((ws, "dm-u1", "private", "u1", True, start))
        t["chats"].rows.append((ws, "grp", "group", None, True, start))
        t["topics"].rows.append((ws, "dm-u1", 0))
        t["topics"].rows.append((ws, "grp", 0))

        # 128 finished conversations: a user message and the reply each.
        msgs: list[tuple[str, str, str, str, datetime]] = []  # id, speaker, hash, thread, time
        for k in range(CONVERSATIONS_PER_WORKSPACE):
            rid = f"r{k:03d}"
            user = user_of(index, k)
            at = start + timedelta(minutes=150 * k)
            thread = f"th{k // 4:02d}"
            repos = ["repo-docs"] if k % REPO_RECORD_EVERY == 0 else []
            t["requests"].rows.append((ws, rid, "b1", chat, 0, user, "interactive", "succeeded",
                                       "fake", "m", 1, 0.01, thread, at, at, at))
            for role, speaker, lines, lo, hi, dt in (
                    ("user", user, _USER_LINES, 200, 400, 0),
                    ("assistant", "b1", _BOT_LINES, 300, 600, 1)):
                body = chat_text(rng, lines, lo, hi)
                digest = content_hash(body)
                mid = f"{rid}-{role[0]}"
                created = at + timedelta(seconds=30 * dt)
                t["messages"].rows.append((ws, mid, rid, role, speaker, body, digest, True,
                                           repos, created))
                msgs.append((mid, speaker, digest, thread, created))

        # 256 records in the full scope, each on real messages at their real hashes.
        scope_id = scope_ids[n]
        ids = record_ids[n * RECORDS_PER_WORKSPACE:(n + 1) * RECORDS_PER_WORKSPACE]
        for j, record_id in enumerate(ids):
            k = j % CONVERSATIONS_PER_WORKSPACE
            width = WIDE_RECORD_SOURCES // 2 if j % WIDE_RECORD_EVERY == 0 else 1
            pairs = [(k + w) % CONVERSATIONS_PER_WORKSPACE for w in range(width)]
            sources = [msgs[2 * p + r] for p in pairs for r in (0, 1)]
            speakers = sorted({s[1] for s in sources if s[1] != "b1"})
            threads = sorted({s[3] for s in sources})
            topic = rng.choice(_TOPICS)
            title = f"{topic.capitalize()}: decision and open items ({j})"
            parts = [f"{speakers[0]} asked about {topic}."]
            if j % WIDE_RECORD_EVERY == 3:
                parts.append(f"It also touches the {SEARCH_TERM} cluster upgrade.")
            while sum(len(p) + 1 for p in parts) < 400 + (j * 37) % 900:
                parts.append(rng.choice(_FILLER))
            # One line per sentence, each citing a source in brackets as an extraction does
            # (line-level citations): the search reads the lines its query finds.
            cites = [sources[i % len(sources)][0] for i in range(len(parts))]
            summary = "\n".join(f"{part} [{mid}]" for part, mid in zip(parts, cites, strict=True))
            created = start + timedelta(minutes=150 * k + 75 * (j // CONVERSATIONS_PER_WORKSPACE),
                                        seconds=j)
            repos = ["repo-docs"] if any(p % REPO_RECORD_EVERY == 0 for p in pairs) else []
            # It rests on everything its batch showed the model: its sources and the other
            # messages of its 20 conversations. The record's copy of its dependencies, as the
            # record_dependencies triggers write it when triggers are on
            # (memory_private.copy_dependencies): ids in bytewise order.
            batch = [msgs[2 * ((k + w) % CONVERSATIONS_PER_WORKSPACE) + r]
                     for w in range(BATCH_CONVERSATIONS) for r in (0, 1)]
            cited = {s[0] for s in sources}
            shown = [b for b in dict.fromkeys(batch) if b[0] not in cited]
            deps = sorted({(s[0], s[2]) for s in sources} | {(b[0], b[2]) for b in shown})
            t["records"].rows.append((ws, record_id, scope_id, "extracted", title, summary,
                                      speakers, threads, repos, "b1-identity", f"r{k:03d}",
                                      created, [d[0] for d in deps], [d[1] for d in deps],
                                      [s[0] for s in sources]))
            # Every message of the record is cited: a dependency that is a source, numbered.
            for pos, (mid, _speaker, digest, _thread, _at) in enumerate(sources, start=1):
                t["record_dependencies"].rows.append((ws, record_id, mid, digest, "cited", pos))
            for mid, _speaker, digest, _thread, _at in shown:
                t["record_dependencies"].rows.append((ws, record_id, mid, digest, "shown", None))
        # The index as a consolidation leaves it: built from the 48 newest records (its
        # candidates, all of which it depends on), naming the 12 newest.
        candidates = sorted(t["records"].rows[-RECORDS_PER_WORKSPACE:],
                            key=lambda r: r[11], reverse=True)[:48]  # type: ignore[arg-type, return-value]
        newest = candidates[:12]
        index_text = "\n".join(f"[#{r[1]}] {str(r[4])[:200]}" for r in newest)
        t["scopes"].rows.append((ws, scope_id, kind, "b1", chat,
                                 "u1" if kind == "private" else None,
                                 None if kind == "private" else 0, start))
        t["scope_indexes"].rows.append((ws, scope_id, index_text, [r[1] for r in newest],
                                        [r[1] for r in candidates], "b1-identity",
                                        sorted({x for r in candidates for x in r[8]}),  # type: ignore[attr-defined]
                                        now))

    with conn.transaction():
        # Foreign-key triggers off while loading consistent data (superuser only), as pg_restore.
        # On Citus the setting must reach the workers' connections too (a SET LOCAL Citus
        # propagates; on plain PostgreSQL the citus.* setting is an unused placeholder).
        conn.execute("set local citus.propagate_set_commands = 'local'")
        conn.execute("set local session_replication_role = replica")
        for name in ("workspaces", "members", "bots", "chats", "topics", "repository_grants",
                     "requests", "messages", "scopes", "records", "record_dependencies",
                     "scope_indexes"):
            _copy(conn, tables[name])
        # Each workspace's memory row, which the workspaces trigger writes when triggers are on
        # (memory_private.workspaces_add_memory_row): the row every memory write, a tool call
        # too, locks first (memory_private.lock_workspace).
        conn.execute(
            "insert into memory_private.workspace_memory (workspace_id) select unnest(%s::text[])",
            ([r[0] for r in tables["workspaces"].rows],))
        # What each index rests on, as the consolidation that built it keeps it.
        conn.execute(
            """insert into memory_private.index_dependencies
                 (workspace_id, scope_id, message_id, content_hash)
               select distinct on (s.workspace_id, s.scope_id, d.message_id)
                      s.workspace_id, s.scope_id, d.message_id, d.content_hash
                 from memory_private.scope_indexes s
                 join memory_private.record_dependencies d
                   on d.workspace_id = s.workspace_id and d.record_id = any(s.candidate_ids)
                where s.workspace_id = any(%s)
                order by s.workspace_id, s.scope_id, d.message_id""",
            ([r[0] for r in tables["workspaces"].rows],))
        # Each record's usage row (never used), which the records trigger writes when triggers
        # are on (memory_private.records_add_usage_row).
        conn.execute(
            """insert into memory_private.record_usage
                 (workspace_id, record_id, last_used_at, usage_count)
               select r.workspace_id, r.record_id, null, 0 from memory_private.records r
                where r.workspace_id = any(%s)""",
            ([r[0] for r in tables["workspaces"].rows],))
        # What the searches read of the records, which the records trigger writes when triggers
        # are on.
        # One call per workspace with its ids read first: on Citus a function that writes
        # cannot run inside a query over the records' shards.
        for row in tables["workspaces"].rows:
            ids = [r[0] for r in conn.execute(
                "select record_id from memory_private.records where workspace_id = %s",
                (row[0],))]
            conn.execute("select memory_private.index_records(%s, %s::bigint[])",
                         (row[0], ids))
    return len(tables["records"].rows)


# How many records' own copies of their dependencies (ids and hashes in bytewise id order,
# sources in their order) differ from record_dependencies: always 0 (the database writes them,
# memory_private.copy_dependencies; the bench's loader writes them itself with triggers off).
DEPENDENCY_COPIES_DIFFERING = """
    select count(*) from memory_private.records r
     cross join lateral (
           select coalesce(array_agg(d.message_id order by d.message_id collate "C"),
                           '{}') as ids,
                  coalesce(array_agg(d.content_hash order by d.message_id collate "C"),
                           '{}') as hashes,
                  coalesce(array_agg(d.message_id order by d.position)
                             filter (where d.position is not null), '{}') as sources
             from memory_private.record_dependencies d
            where d.workspace_id = r.workspace_id and d.record_id = r.record_id) x
     where (r.dependency_ids, r.dependency_hashes, r.source_ids)
           is distinct from (x.ids, x.hashes, x.sources)"""


# How many records have no usage row: always 0 (made with the record by
# memory_private.records_add_usage_row; the bench's loader writes them itself with triggers off).
RECORDS_WITHOUT_USAGE = """
    select count(*) from memory_private.records r
     where not exists (select 1 from memory_private.record_usage u
                        where u.workspace_id = r.workspace_id and u.record_id = r.record_id)"""


# How many workspaces have no memory row: always 0 (made with the workspace by
# memory_private.workspaces_add_memory_row; the bench's loader writes them itself with triggers
# off). Without it a tool call's memory lock would lock nothing.
WORKSPACES_WITHOUT_MEMORY_ROW = """
    select count(*) from memory_private.workspaces w
     where not exists (select 1 from memory_private.workspace_memory m
                        where m.workspace_id = w.workspace_id)"""


def check_consistency(conn: psycopg.Connection) -> dict[str, int]:
    """Counts what would have failed a foreign-key check or a hash check (all zero when good)."""
    row = conn.execute(
        """
        select
          (select count(*) from memory_private.record_dependencies rs
            where not exists (select 1 from memory_private.messages m
                               where m.workspace_id = rs.workspace_id
                                 and m.message_id = rs.message_id
                                 and m.content_hash = rs.content_hash)),
          (select count(*) from memory_private.records r
            where not exists (select 1 from memory_private.scopes s
                               where s.workspace_id = r.workspace_id
                                 and s.scope_id = r.scope_id)),
          (select count(*) from (select * from memory_private.messages
                                  where workspace_id like 'bench-%%' limit 2000) m
            where m.content_hash <> memory_private.content_hash(m.body))
        """).fetchone()
    copies = conn.execute(DEPENDENCY_COPIES_DIFFERING).fetchone()
    usage = conn.execute(RECORDS_WITHOUT_USAGE).fetchone()
    memory_rows = conn.execute(WORKSPACES_WITHOUT_MEMORY_ROW).fetchone()
    assert row is not None and copies is not None and usage is not None
    assert memory_rows is not None
    return {"sources_without_message": int(row[0]), "records_without_scope": int(row[1]),
            "hash_mismatches_in_sample": int(row[2]),
            "records_without_usage": int(usage[0]),
            "workspaces_without_memory_row": int(memory_rows[0]),
            "dependency_copies_differing": int(copies[0])}


def grow(conn: psycopg.Connection, have: int, want: int, *, now: datetime,
         batch: int = 50) -> int:
    """Adds workspaces ``have .. want-1``; returns the number of records written."""
    written = 0
    for lo in range(have, want, batch):
        written += build_workspaces(conn, range(lo, min(lo + batch, want)), now=now)
    settle(conn)
    return written


# Every table the loader writes, the searches' derived tables included (an index-only scan of
# a table whose visibility map is not set reads the table too).
SETTLED_TABLES = ("workspaces", "workspace_memory", "members", "bots", "chats", "topics",
                  "repository_grants", "requests", "messages", "scopes", "records",
                  "record_dependencies", "record_usage", "record_texts", "record_documents",
                  "scope_words", "index_dependencies")


def settle(conn: psycopg.Connection) -> None:
    """Leaves the loaded tables as a database that has lived a while would have them: hint bits
    set, visibility map current, statistics fresh, dirty buffers written. Otherwise the first
    reads after a bulk load dirty every page they touch (hint bits) and the measurements pay
    for writes that a settled database never makes."""
    conn.execute("vacuum (analyze) "
                 + ", ".join(f"memory_private.{name}" for name in SETTLED_TABLES))
    conn.execute("checkpoint")
