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
from pyworker.schema import CitusCluster
from pyworker.terminal import emit, fitted_table

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


def gather_status(db: Database, workspace_id: str | None = None,
                  limit: int = 20) -> dict[str, list[dict[str, Any]]]:
    """The rows ``pimem status`` shows: workspaces, what waits to become a memory and why,
    scopes (across workspaces only those needing a look), jobs needing attention and the
    requests memory charged most. Given a workspace, the database reads that one only.

    The validity rule runs once per scope: the scopes' rows carry their counts, and each
    workspace's are the sums of its scopes' (what memory.workspace_status would count again,
    so it is read without them)."""
    scopes = db.view_rows("scope_status", workspace_id=workspace_id,
                          order_by=("workspace_id", "scope_id"))
    workspaces = db.view_rows("workspace_status", workspace_id=workspace_id,
                              order_by=("workspace_id",), count_records=False)
    for w in workspaces:
        w.update(_record_counts([s for s in scopes if s["workspace_id"] == w["workspace_id"]]))
    if not workspace_id:
        # Across workspaces, only the scopes with something to look at.
        scopes = [s for s in scopes if needs_a_look(s)][:limit]
    jobs = db.view_rows("job_status", workspace_id=workspace_id, where={"status": ATTENTION},
                        order_by=("-created_at",))
    jobs = [j for j in jobs if j["retried_as_job_id"] is None]
    jobs.sort(key=lambda j: (j["status"] != "stopped", j["status"] != "running"))
    return {
        "workspaces": workspaces,
        "waiting": db.waiting(workspace_id),
        "scopes": scopes,
        "jobs": jobs[:limit],
        "charges": db.view_rows("request_memory_charges", workspace_id=workspace_id,
                                order_by=("-memory_spent_usd",), limit=limit),
    }


def _record_counts(scopes: list[dict[str, Any]]) -> dict[str, Any]:
    """A workspace's record counts from its scopes' rows: valid, invalid, invalid by reason."""
    by_reason: dict[str, int] = {}
    for s in scopes:
        for reason, n in (s["invalid_by_reason"] or {}).items():
            by_reason[reason] = by_reason.get(reason, 0) + int(n)
    return {"records_valid": sum(s["records_valid"] for s in scopes),
            "records_invalid": sum(s["records_invalid"] for s in scopes),
            "invalid_by_reason": by_reason}


def cluster_line(cluster: CitusCluster | None, width: int = 80) -> str:
    """Where the memory lives: one PostgreSQL server, or a Citus cluster and its nodes. Lines of
    at most ``width`` columns, never cutting a node's address (the nodes go on lines of their
    own when they do not fit beside the heading)."""
    if cluster is None:
        return "one PostgreSQL server (no Citus)"
    if not cluster.coordinator:
        return "a Citus worker node: run pimem status on the coordinator"
    if not cluster.distributed:
        return "Citus coordinator, schema not distributed yet (pimem migrate distributes it)"
    heading = f"Citus coordinator, schema distributed on {len(cluster.workers)} worker node(s):"
    one = f"{heading} {', '.join(cluster.workers)}"
    if len(one) <= width:
        return one
    lines = [heading]
    for node in cluster.workers:
        if len(lines) > 1 and len(lines[-1]) + len(node) + 2 <= width:
            lines[-1] += f", {node}"
        else:
            lines[-1] += "," if len(lines) > 1 else ""
            lines.append(f"  {node}")
    return "\n".join(lines)


def needs_a_look(scope: dict[str, Any]) -> bool:
    """A scope with invalid records, a consolidation due or recall off."""
    return bool(scope["records_invalid"] or scope["consolidation_pending"]
                or not scope["recall_enabled"])


def _lines(*parts: str | None) -> str:
    return "\n".join(p for p in parts if p)


def _by_reason(value: dict[str, int] | None) -> list[str]:
    return [f" {k} {v}" for k, v in sorted((value or {}).items())]


def render_status(data: dict[str, list[dict[str, Any]]], console: Console, *,
                  workspace_id: str | None = None) -> None:
    """The status as tables that read at 80 columns (pyworker/terminal.py)."""
    data = sanitize(data)
    tables = [_workspaces(data["workspaces"]), _waiting(data.get("waiting", [])),
              _scopes(data["scopes"], workspace_id), _jobs(data["jobs"]),
              _charges(data["charges"])]
    emit(console, *tables)


def _workspaces(rows: list[dict[str, Any]]) -> Table:
    cells = [[_lines(w["workspace_id"], "[yellow]PAUSED[/yellow]" if w["paused"] else None,
                     f"config {w['config_version']}"),
              _lines(f"left {money(w['budget_left_usd'])}",
                     f"memory {money(w['memory_spent_usd'])}"),
              _lines(f"{w['records_valid']} ok", f"{w['records_invalid']} invalid",
                     *_by_reason(w["invalid_by_reason"])),
              _lines(f"{w['jobs_pending']} pending", f"{w['jobs_due']} due",
                     f"{w['jobs_running']} running",
                     f"[red]{w['jobs_stopped']} stopped[/red]" if w["jobs_stopped"]
                     else "0 stopped"),
              _lines(f"oldest job {age(w['oldest_pending_age'])}",
                     f"{w['consolidations_pending']} consol. due",
                     f"{w['tombstones']} tombstones")]
             for w in rows]
    return fitted_table("Workspaces", ("workspace", "budget", "records", "jobs", "other"),
                        cells)


def _waiting(rows: list[dict[str, Any]]) -> Table:
    cells = [[r["workspace_id"], str(r["conversations"]), when(r["next_change_at"]),
              _lines(f"[bold]{r['reason']}[/bold]", r["explanation"])]
             for r in rows]
    table = fitted_table("Waiting to become memories, and why (conversations by reason)",
                         ("workspace", "conv.", "moves on at", "reason"), cells,
                         keep=(0, 2), right=(1,))
    if not rows:
        table.caption = "nothing waits: every finished conversation is a memory"
        table.caption_justify = "left"
    return table


def _scopes(rows: list[dict[str, Any]], workspace_id: str | None) -> Table:
    title = (f"Scopes of workspace {workspace_id}" if workspace_id else
             "Scopes needing a look (invalid records, a consolidation due or recall off; "
             "--workspace lists all)")
    cells = []
    for s in rows:
        who = f"user {s['user_id']}" if s["kind"] == "private" else f"topic {s['topic_id']}"
        jobs = [f"{p} #{s[f'{p}_job_id']} {s[f'{p}_job_status']}"
                for p in ("extract", "consolidate") if s[f"{p}_job_id"]]
        cells.append([
            _lines(s["workspace_id"], f"#{s['scope_id']} {s['kind']}",
                   "recall on" if s["recall_enabled"] else "[red]recall off[/red]"),
            _lines(f"bot {s['bot_id']}", f"chat {s['chat_id']}", who),
            _lines(f"{s['records_valid']} ok", f"{s['records_invalid']} invalid",
                   *_by_reason(s["invalid_by_reason"])),
            _lines(f"index {s['index_records']}, {age(s['index_age'])}",
                   "[yellow]consolidation due[/yellow]" if s["consolidation_pending"]
                   else "index current",
                   *jobs, f"{s['tombstones']} tombstones")])
    return fitted_table(title, ("scope", "where", "records", "index and jobs"), cells,
                        keep=(0, 1))


def _jobs(rows: list[dict[str, Any]]) -> Table:
    cells = []
    for j in rows:
        if j["status"] == "stopped":
            todo = (f"retry: select memory.retry_job('{j['workspace_id']}', {j['job_id']})"
                    if j["retry_refusal"] is None else f"no retry: {j['retry_refusal']}")
        elif j["stale_reason"]:
            todo = f"stale ({j['stale_reason']}): maintenance retires it"
        else:
            todo = None
        status = {"stopped": "[red]stopped[/red]", "running": "[cyan]running[/cyan]"}.get(
            j["status"], j["status"])
        last = (f"last #{j['last_attempt_no']} {j['last_attempt_outcome']}"
                if j["last_attempt_no"] else "no attempt")
        cells.append([
            _lines(j["workspace_id"], f"#{j['job_id']} {j['phase']}"),
            _lines(status, f"age {age(j['age'])}", f"claims {j['claims']}/3"),
            _lines(last, f"next {when(j['next_attempt_at'])}" if j["next_attempt_at"] else None),
            _lines(j["last_error"] or "-", todo)])
    return fitted_table("Jobs needing attention (stopped first)",
                        ("job", "status", "attempts", "last error, what to do"), cells)


def _charges(rows: list[dict[str, Any]]) -> Table:
    cells = [[_lines(c["workspace_id"], c["request_id"]),
              f"{c['model_provider']}/{c['model_id']}",
              _lines(f"{c['extract_attempts']} extract", f"{c['consolidate_attempts']} consol.",
                     f"{c['failed_attempts']} failed", f"{c['unknown_attempts']} unknown"),
              _lines(f"in {c['input_tokens']}", f"out {c['output_tokens']}"),
              _lines(money(c["memory_spent_usd"]), f"left {money(c['budget_left_usd'])}")]
             for c in rows]
    return fitted_table("Memory charges by request (largest first)",
                        ("request", "model", "attempts", "tokens", "memory $"), cells,
                        keep=(0, 1))


def render_explain(data: dict[str, Any], console: Console) -> None:
    """One record's explanation: verdict, the checks in rule order, and what it was made from
    (its dependencies, with its sources marked by their place). A forgotten record: when, by
    whom, with which others."""
    data = sanitize(data)
    if data.get("exists") is False:
        gone = data["forgotten"]
        others = [i for i in gone.get("forgotten_ids") or [] if i != data["record_id"]]
        console.print(
            f"record {data['record_id']} in workspace {data['workspace_id']}: "
            f"[red]FORGOTTEN[/red] at {gone['at']} by {gone['by_user_id']} (manage_memory "
            f"forget of memory {gone['memory_id']}, request {gone['request_id']}, tool call "
            f"{gone['tool_call_id']}, scope {gone['scope_id']})"
            + (f"; forgotten with {', '.join(str(i) for i in others)}" if others else ""),
            highlight=False)
        return
    scope = data["scope"]
    record = data["record"]
    who = scope["user_id"] if scope["kind"] == "private" else f"topic {scope['topic_id']}"
    verdict = ("[green]VALID[/green]" if data["valid"]
               else f"[red]INVALID[/red]: {data['invalid_reason']}")
    requester = f" for requester {data['requester']}" if data.get("requester") else ""
    console.print(f"record {data['record_id']} in workspace {data['workspace_id']}{requester}: "
                  f"{verdict}", highlight=False)
    console.print(f"scope {scope['scope_id']} ({scope['kind']}: {scope['bot_id']} / "
                  f"{scope['chat_id']} / {who}), recall "
                  f"{'on' if scope['recall_enabled'] else 'off'}; {record['kind']}, made "
                  f"{record['created_at']} from request {record['origin_request_id']}, used "
                  f"{record['usage_count']}x, in index: {record['in_index']}", highlight=False)

    rows = []
    first = True
    for c in data["checks"]:
        mark = "[green]ok[/green]" if c["ok"] else ("[red]FAILS[/red]" if first else "[red]fails[/red]")
        if not c["ok"]:
            first = False
        rows.append([c["check"], mark, c.get("reason") or "-", c["detail"]])
    tables = [fitted_table("Checks (in the order recall applies them)",
                           ("check", "ok", "reason if not", "detail"), rows, keep=(0, 2))]

    cited = {m: n for n, m in enumerate(data.get("sources") or [], start=1)}
    rows = []
    for s in data["dependencies"]:
        state = s["state"] if s["state"] == "current" else f"[red]{s['state']}[/red]"
        rows.append([
            s["message_id"],
            _lines(s["via"], f"source {cited[s['message_id']]}" if s["message_id"] in cited
                   else None),
            _lines(s["role"], s["speaker_id"]),
            _lines(state, "tombstoned" if s["tombstoned"] else None),
            _lines(f"used {(s['recorded_hash'] or '-')[:12]}",
                   f"now {(s['current_hash'] or '-')[:12]}"),
            _lines(f"retain until {s['retain_until']}" if s["retain_until"] else None,
                   f"removed {s['removed_at']}" if s["removed_at"] else None) or "-"])
    tables.append(fitted_table(
        "What it was made from (hash prefixes, never text); source = its place among the "
        "messages it cites", ("message", "via", "who", "state", "hash", "dates"), rows,
        keep=(0, 2)))
    if data.get("lines"):
        tables.append(fitted_table(
            "Which line of the summary cites which source", ("line", "sources"),
            [[str(line["line"]), ", ".join(str(i) for i in line["sources"])]
             for line in data["lines"]], right=(0,)))
    emit(console, *tables)
