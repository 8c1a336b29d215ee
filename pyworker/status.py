"""``pimem status`` and ``pimem explain``: the operator views as tables in the terminal.

Everything shown comes from the ``memory`` operator views and ``memory.explain_record``
(sql/80_operator.sql), read through :class:`pyworker.db.Database`; nothing here decides a rule.
Connect as a role that is a member of ``memory_operator``. No view carries message text, titles or
summaries, so neither does this output. Every string from the database is printed without its
control characters (an id or an error could carry terminal escape sequences) and with rich's
markup escaped, so a value can neither drive the operator's terminal nor restyle the table.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pyworker.db import Database

# Jobs an operator may need to look at: everything not finished, and stopped jobs nobody retried.
ATTENTION = ["pending", "running", "stopped"]


# C0 and C1 control characters but tab and line feed (ESC starts a terminal escape sequence; a
# summary's lines stay lines) and the invisible direction and format marks that can make a
# terminal show text other than what is stored.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
                          "\ufeff\ufff9-\ufffb]")


def printable(text: str) -> str:
    """The text without control characters (tabs and line feeds stay), each replaced by a
    visible ``?``."""
    return _UNPRINTABLE.sub("?", text)


def sanitize(value: Any) -> Any:
    """A value from the database made safe to print in a rich table: every string (also in
    nested dicts and lists) without control characters and with markup escaped."""
    if isinstance(value, str):
        return escape(printable(value))
    if isinstance(value, dict):
        return {k: sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitize(v) for v in value]
    return value


def age(value: timedelta | None) -> str:
    """A short human duration: ``45s``, ``12m``, ``3h 05m``, ``2d 04h``."""
    if value is None:
        return "-"
    seconds = int(value.total_seconds())
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 60:
        return f"{sign}{seconds}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if hours == 0:
        return f"{sign}{minutes}m"
    if days == 0:
        return f"{sign}{hours}h {minutes % 60:02d}m"
    return f"{sign}{days}d {hours % 24:02d}h"


def when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def money(value: Decimal | float | None) -> str:
    return "-" if value is None else f"${Decimal(value):.4f}"


def reasons(value: dict[str, int] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((value or {}).items())) or "-"


def clip(text: str | None, limit: int = 90) -> str:
    if not text:
        return "-"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def yes(flag: bool | None) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"


def gather_status(db: Database, workspace_id: str | None = None,
                  limit: int = 20) -> dict[str, list[dict[str, Any]]]:
    """The rows ``pimem status`` shows: workspaces, scopes, jobs needing attention and the
    requests memory charged most."""
    only = {"workspace_id": workspace_id} if workspace_id else {}
    scopes = db.view_rows("scope_status", where=only,
                          order_by=("workspace_id", "scope_id"), limit=None)
    if not workspace_id:
        # Across workspaces, only the scopes with something to look at.
        scopes = [s for s in scopes if s["records_invalid"] or s["consolidation_pending"]
                  or not s["recall_enabled"]][:limit]
    jobs = db.view_rows("job_status", where={**only, "status": ATTENTION},
                        order_by=("-created_at",), limit=None)
    jobs = [j for j in jobs if j["retried_as_job_id"] is None]
    jobs.sort(key=lambda j: (j["status"] != "stopped", j["status"] != "running"))
    return {
        "workspaces": db.view_rows("workspace_status", where=only, order_by=("workspace_id",)),
        "scopes": scopes,
        "jobs": jobs[:limit],
        "charges": db.view_rows("request_memory_charges", where=only,
                                order_by=("-memory_spent_usd",), limit=limit),
    }


def render_status(data: dict[str, list[dict[str, Any]]], console: Console) -> None:
    data = sanitize(data)
    ws = Table(title="Workspaces", title_justify="left")
    for col in ("workspace", "paused", "config", "budget left", "memory $", "records ok",
                "invalid (by reason)", "consolidations due", "jobs pend/due/run/stop",
                "oldest pending", "tombstones"):
        ws.add_column(col)
    for w in data["workspaces"]:
        ws.add_row(w["workspace_id"], "[yellow]PAUSED[/yellow]" if w["paused"] else "no",
                   str(w["config_version"]), money(w["budget_left_usd"]),
                   money(w["memory_spent_usd"]), str(w["records_valid"]),
                   f"{w['records_invalid']} ({reasons(w['invalid_by_reason'])})",
                   str(w["consolidations_pending"]),
                   f"{w['jobs_pending']}/{w['jobs_due']}/{w['jobs_running']}/"
                   f"{w['jobs_stopped']}", age(w["oldest_pending_age"]), str(w["tombstones"]))
    console.print(ws)

    sc = Table(title="Scopes", title_justify="left")
    for col in ("workspace", "scope", "kind", "bot / chat / user-or-topic", "recall", "ok",
                "invalid (by reason)", "index (records, age)", "consolidation", "open jobs",
                "tombstones"):
        sc.add_column(col)
    for s in data["scopes"]:
        who = s["user_id"] if s["kind"] == "private" else f"topic {s['topic_id']}"
        open_jobs = ", ".join(f"{p} #{s[f'{p}_job_id']} {s[f'{p}_job_status']}"
                              for p in ("extract", "consolidate") if s[f"{p}_job_id"]) or "-"
        sc.add_row(s["workspace_id"], str(s["scope_id"]), s["kind"],
                   f"{s['bot_id']} / {s['chat_id']} / {who}", yes(s["recall_enabled"]),
                   str(s["records_valid"]),
                   f"{s['records_invalid']} ({reasons(s['invalid_by_reason'])})",
                   f"{s['index_records']}, {age(s['index_age'])}",
                   "[yellow]pending[/yellow]" if s["consolidation_pending"] else "current",
                   open_jobs, str(s["tombstones"]))
    console.print(sc)

    jb = Table(title="Jobs needing attention (stopped first)", title_justify="left")
    for col in ("workspace", "job", "phase", "status", "age", "claims", "next attempt",
                "last attempt", "last error", "what to do"):
        jb.add_column(col)
    for j in data["jobs"]:
        if j["status"] == "stopped":
            todo = (f"retry: select memory.retry_job('{j['workspace_id']}', {j['job_id']})"
                    if j["retry_refusal"] is None else f"no retry: {clip(j['retry_refusal'], 80)}")
        elif j["stale_reason"]:
            todo = f"stale ({clip(j['stale_reason'], 60)}): maintenance retires it"
        else:
            todo = "-"
        status = {"stopped": "[red]stopped[/red]", "running": "[cyan]running[/cyan]"}.get(
            j["status"], j["status"])
        last = (f"#{j['last_attempt_no']} {j['last_attempt_outcome']}"
                if j["last_attempt_no"] else "-")
        jb.add_row(j["workspace_id"], str(j["job_id"]), j["phase"], status, age(j["age"]),
                   f"{j['claims']}/3", when(j["next_attempt_at"]), last, clip(j["last_error"]),
                   todo)
    console.print(jb)

    ch = Table(title="Memory charges by request (largest first)", title_justify="left")
    for col in ("workspace", "request", "model", "attempts ext/cons", "failed/unknown",
                "tokens in/out", "memory $", "budget left"):
        ch.add_column(col)
    for c in data["charges"]:
        ch.add_row(c["workspace_id"], c["request_id"], f"{c['model_provider']}/{c['model_id']}",
                   f"{c['extract_attempts']}/{c['consolidate_attempts']}",
                   f"{c['failed_attempts']}/{c['unknown_attempts']}",
                   f"{c['input_tokens']}/{c['output_tokens']}", money(c["memory_spent_usd"]),
                   money(c["budget_left_usd"]))
    console.print(ch)


def render_explain(data: dict[str, Any], console: Console) -> None:
    """One record's explanation: verdict, the checks in rule order, and what it was made from
    (its dependencies, with its sources marked by their place)."""
    data = sanitize(data)
    scope = data["scope"]
    record = data["record"]
    who = scope["user_id"] if scope["kind"] == "private" else f"topic {scope['topic_id']}"
    verdict = ("[green]VALID[/green]" if data["valid"]
               else f"[red]INVALID[/red]: {data['invalid_reason']}")
    requester = f" for requester {data['requester']}" if data.get("requester") else ""
    console.print(f"record {data['record_id']} in workspace {data['workspace_id']}{requester}: "
                  f"{verdict}")
    console.print(f"scope {scope['scope_id']} ({scope['kind']}: {scope['bot_id']} / "
                  f"{scope['chat_id']} / {who}), recall "
                  f"{'on' if scope['recall_enabled'] else 'off'}; {record['kind']}, made "
                  f"{record['created_at']} from request {record['origin_request_id']}, used "
                  f"{record['usage_count']}x, in index: {record['in_index']}", highlight=False)

    checks = Table(title="Checks (in the order recall applies them)", title_justify="left")
    for col in ("check", "ok", "reason if not", "detail"):
        checks.add_column(col)
    first = True
    for c in data["checks"]:
        mark = "[green]ok[/green]" if c["ok"] else ("[red]FAILS[/red]" if first else "[red]fails[/red]")
        if not c["ok"]:
            first = False
        checks.add_row(c["check"], mark, c.get("reason") or "-", c["detail"])
    console.print(checks)

    cited = {m: n for n, m in enumerate(data.get("sources") or [], start=1)}
    deps = Table(title="What it was made from (content hashes, never text); "
                       "source = its place among the messages it cites", title_justify="left")
    for col in ("message", "via", "source", "role", "speaker", "state", "hash when used",
                "hash now", "retain until", "removed", "tombstoned"):
        deps.add_column(col)
    for s in data["dependencies"]:
        state = s["state"] if s["state"] == "current" else f"[red]{s['state']}[/red]"
        deps.add_row(s["message_id"], s["via"], str(cited.get(s["message_id"], "-")), s["role"],
                     s["speaker_id"], state,
                     (s["recorded_hash"] or "-")[:16], (s["current_hash"] or "-")[:16],
                     str(s["retain_until"] or "-"), str(s["removed_at"] or "-"),
                     "yes" if s["tombstoned"] else "no")
    console.print(deps)
    if data.get("lines"):
        lines = Table(title="Which line of the summary cites which source", title_justify="left")
        for col in ("line", "sources"):
            lines.add_column(col)
        for line in data["lines"]:
            lines.add_row(str(line["line"]), ", ".join(str(i) for i in line["sources"]))
        console.print(lines)
