"""``pimem eval``: does recall find what was said? Measured on LoCoMo conversations.

For each conversation (a LoCoMo JSON file; nothing is downloaded) and each variant (``group``:
a group topic, ``private``: a private chat; :mod:`pyworker.lab.locomo` says how a two-person
dialogue becomes requests), the eval

1. ingests the conversation through the public API session by session, moving the memory clock
   past the idle window and running the real worker with the chosen adapter after each session
   (``offline``, ``replay``, ``pi`` or ``openai``);
2. asks every question as a new interactive request of the same chat (its user message is the
   question): ``memory.recall`` for what the request starts with, then ``memory.query_memories``
   with the whole question as the query, as a model would pass it;
3. judges each answer by the question's evidence (the dataset's turn ids that answer it): a hit
   when any evidence turn is a source of what was shown.

A record's sources, as the judge reads them (``--judge``): ``api`` (the default), the sources the
API shows: ``source_ids`` of each query_memories result, and for recall and coverage the record's
sources as ``memory.explain_record`` lists them; ``citations``, the message ids its summary cites
inline (``[id, ...]``, as the offline and replay adapters write each line). The two agree once a
record's sources are exactly the ids its output cites; while a record's sources are every
message of its batch (and of the memories shown with it), ``api`` credits a record with turns it
never used, and only ``citations`` measures the summaries.

Measures, per category and overall:
- ``recall``: an evidence turn is a source of a record recall shows (the index's records, or the
  directory's);
- ``hit@1/@5/@12`` and ``mrr``: the first search result whose shown source ids (the first 20
  query_memories gives) include an evidence turn, at rank 1, within 5, within 12; the mean of
  1/rank (0 when none);
- ``coverage``: an evidence turn is a source of any valid record of the scope (the ceiling of
  the two above); in the JSON also ``coverage_all`` (every evidence turn is) and ``newest@5``
  (an evidence turn is a source of one of the five newest records: what hit@5 would be if the
  search ranked by age alone);
and records (count, bytes, sources), the share of turns some record cites, jobs, and timings.
Questions whose evidence names no turn of the conversation are left out and counted. Writes
``eval.json`` (everything, per question too), prints a table, and draws ``eval.png`` when
matplotlib (the ``bench`` extra) is installed. With ``provenance`` (``--provenance``), each run
also measures what its records depend on and what removing each message invalidates
(:mod:`pyworker.lab.provenance`, docs/retention.md), before the questions are asked.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pyworker.adapters.base import Adapter
from pyworker.db import Database
from pyworker.lab import locomo
from pyworker.payload import ModelRef
from pyworker.terminal import emit, fitted_table

ADAPTERS = ("offline", "replay", "pi", "openai")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop",
              5: "adversarial"}
METRICS = ("recall", "hit@1", "hit@5", "hit@12", "mrr", "coverage")
EVAL_DB = "pimem_eval"
JUDGES = ("api", "citations")
_CITED = re.compile(r"\[([^\[\]]+)\]")


@dataclass
class Answer:
    """How one question fared."""

    conversation: str
    variant: str
    index: int
    category: int
    question: str
    evidence: list[str]        # message ids
    recall_mode: str
    recall_hit: bool
    rank: int | None           # of the first search result citing an evidence turn
    match: str | None          # how that result matched (literal, words, fuzzy)
    results: int
    covered: bool
    covered_all: bool          # every evidence turn is a source of some record
    newest_hit: bool           # ... of one of the 5 newest records (a baseline for hit@5)
    recall_ms: float
    query_ms: float


# The database -----------------------------------------------------------------------------------


@contextmanager
def eval_database(dsn: str | None, server: str, data_dir: Path) -> Iterator[tuple[str, str]]:
    """The database to run in, migrated: ``dsn`` as given (a superuser connection: the eval
    moves the memory clock; earlier copies of its workspaces are replaced), or a fresh
    ``pimem_eval`` database in the embedded PostgreSQL (``server="embedded"``, data in
    ``data_dir``) or in a throwaway cluster of the machine's binaries (``"local"``)."""
    from pyworker import schema
    from pyworker.lab.servers import fresh_database

    with fresh_database(EVAL_DB, dsn=dsn, server=server, data_dir=data_dir) as (target, where):
        with psycopg.connect(target, autocommit=True) as conn:
            row = conn.execute("select rolsuper from pg_roles where rolname = current_user")
            if not (row.fetchone() or (False,))[0]:
                raise ValueError("pimem eval needs a superuser connection (it moves the memory "
                                 "clock)")
            present = conn.execute("select 1 from pg_namespace where nspname = 'memory'")
            has_schema = present.fetchone() is not None
        if not has_schema:
            schema.migrate(target)
        yield target, where


# Asking -----------------------------------------------------------------------------------------


def cited_ids(summary: str) -> list[str]:
    """The ids a summary cites inline, in order: every ``[a, b]`` group's comma-separated
    items (the offline and replay adapters cite each line's sources this way)."""
    out: list[str] = []
    for group in _CITED.findall(summary or ""):
        for item in group.split(","):
            item = item.strip()
            if item and item not in out:
                out.append(item)
    return out


def record_sources(db: Database, layout: locomo.Layout, judge: str) -> dict[int, list[str]]:
    """Every valid record of the workspace with its sources as the judge reads them: ``api``,
    the record's sources as ``memory.explain_record`` lists them (operator API); ``citations``,
    the message ids its summary cites inline (read with ``memory.query_memories`` by id, one
    request for all)."""
    ws = layout.workspace
    rows = db.view_rows("record_status", workspace_id=ws, where={"valid": True},
                        order_by=("record_id",))
    out: dict[int, list[str]] = {}
    if judge == "citations" and rows:
        reader = "eval-reader"
        db.call("upsert_request", ws, reader, locomo.BOT, layout.chat, layout.topic, layout.asker,
                "interactive", "running", layout.model.provider, layout.model.id, 1.0, 0.0)
    for row in rows:
        rid = int(row["record_id"])
        if judge == "api":
            explained = db.explain_record(ws, rid)
            out[rid] = [str(s) for s in explained.get("sources") or []]
        else:
            found = db.query_memories(ws, "eval-reader", f"read-{rid}", {"id": rid})
            out[rid] = [i for rec in found.get("records") or [] for i in cited_ids(rec["summary"])]
    return out


def shown_sources(rec: dict[str, Any], judge: str) -> list[str]:
    """The sources of one query_memories result as the judge reads them."""
    if judge == "api":
        return list(rec.get("source_ids") or [])
    return cited_ids(str(rec.get("summary") or ""))


def ask(db: Database, layout: locomo.Layout, question: locomo.Question,
        sources: dict[int, list[str]], conv_name: str, judge: str) -> Answer:
    """One question as a new request: recall, then query_memories with the whole question."""
    rid = f"q-{question.index:04d}"
    db.call("upsert_request", layout.workspace, rid, locomo.BOT, layout.chat, layout.topic,
            layout.asker, "interactive", "running", layout.model.provider, layout.model.id,
            1.0, 0.0)
    db.call("upsert_message", layout.workspace, f"{rid}/question", rid, "user", layout.asker,
            question.question, True)
    evidence = [locomo.message_id(d) for d in question.evidence]
    wanted = set(evidence)

    began = time.perf_counter()
    recalled = db.recall(layout.workspace, rid)
    recall_ms = (time.perf_counter() - began) * 1000
    shown = [int(r["id"]) for r in recalled.get("records") or []]
    recall_hit = any(wanted & set(sources.get(i, ())) for i in shown)

    began = time.perf_counter()
    query = question.question.encode()[:1000].decode("utf-8", "ignore")  # the API's limit
    found = db.query_memories(layout.workspace, rid, "search", {"query": query})
    query_ms = (time.perf_counter() - began) * 1000
    rank = match = None
    results = found.get("records") or []
    for pos, rec in enumerate(results, start=1):
        if wanted & set(shown_sources(rec, judge)):
            rank, match = pos, rec.get("match")
            break
    cited = set().union(*sources.values()) if sources else set()
    newest = sorted(sources, reverse=True)[:5]  # record ids grow with time
    return Answer(conv_name, layout.variant, question.index, question.category,
                  question.question, evidence, str(recalled.get("mode")), recall_hit, rank,
                  match, len(results), bool(wanted & cited), wanted <= cited,
                  any(wanted & set(sources[i]) for i in newest),
                  round(recall_ms, 3), round(query_ms, 3))


# Scoring ----------------------------------------------------------------------------------------


def score(answers: Sequence[Answer]) -> dict[str, Any]:
    """The shares (0..1) of the measures over some answers, with their count."""
    n = len(answers)
    if n == 0:
        return {"questions": 0}

    def share(pred: Callable[[Answer], bool]) -> float:
        return round(sum(1 for a in answers if pred(a)) / n, 4)

    return {"questions": n,
            "recall": share(lambda a: a.recall_hit),
            "hit@1": share(lambda a: a.rank is not None and a.rank <= 1),
            "hit@5": share(lambda a: a.rank is not None and a.rank <= 5),
            "hit@12": share(lambda a: a.rank is not None),
            "mrr": round(sum(1 / a.rank for a in answers if a.rank) / n, 4),
            "coverage": share(lambda a: a.covered),
            "coverage_all": share(lambda a: a.covered_all),
            "newest@5": share(lambda a: a.newest_hit),
            "first_hit_by": {m: sum(1 for a in answers if a.match == m)
                             for m in sorted({a.match for a in answers if a.match})}}


def by_category(answers: Sequence[Answer]) -> dict[str, Any]:
    out = {f"{c} {name}": score([a for a in answers if a.category == c])
           for c, name in CATEGORIES.items()}
    others = sorted({a.category for a in answers} - set(CATEGORIES))
    for c in others:
        out[f"{c}"] = score([a for a in answers if a.category == c])
    out["overall"] = score(answers)
    return {k: v for k, v in out.items() if v["questions"]}


def _ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 3),
            "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3)}


def store_facts(db: Database, workspace: str, sources: dict[int, list[str]],
                turns: int) -> dict[str, Any]:
    rows = db.view_rows("record_status", workspace_id=workspace, where={"valid": True})
    scopes = db.view_rows("scope_status", workspace_id=workspace)
    cited = set().union(*sources.values()) if sources else set()
    return {"records": len(rows),
            "record_bytes": sum(int(r["title_bytes"]) + int(r["summary_bytes"]) for r in rows),
            "sources_per_record": round(statistics.mean(len(s) for s in sources.values()), 2)
            if sources else 0,
            "index_bytes": sum(int(s["index_bytes"] or 0) for s in scopes),
            "turns": turns,
            "turns_cited": round(len({c for c in cited if "/" not in c}) / turns, 4)
            if turns else 0}


# One run ----------------------------------------------------------------------------------------


def make_eval_adapter(name: str, conv: locomo.Conversation, *, pi_models: Path | None = None,
                      openai_base_url: str | None = None) -> Adapter:
    if name == "replay":
        from pyworker.lab.replay import ReplayAdapter

        return ReplayAdapter(locomo.facts_by_message(conv))
    from pyworker.adapters import make_adapter

    return make_adapter(name, pi_models=pi_models, openai_base_url=openai_base_url)


def evaluate_conversation(db: Database, dsn: str, conv: locomo.Conversation,
                          variant: locomo.Variant, adapter: Adapter, model: ModelRef,
                          progress: Progress | None = None,
                          max_questions: int | None = None,
                          judge: str = "api", provenance: bool = False) -> dict[str, Any]:
    """Ingests one conversation in one variant and asks its questions; the result section
    (with ``provenance``, also what each record depends on and what removing each message
    invalidates: :mod:`pyworker.lab.provenance`, measured before the questions)."""
    label = escape(f"{conv.name} {variant}")  # a name from the dataset file: no markup
    task = progress.add_task(f"{label}: sessions", total=len(conv.sessions)) if progress else None

    def advance(_s: locomo.Session) -> None:
        if progress is not None and task is not None:
            progress.advance(task)

    ingested = locomo.ingest_conversation(db, dsn, conv, variant, adapter, model,
                                          on_session=advance)
    layout = ingested.layout
    sources = record_sources(db, layout, judge)
    measured: dict[str, Any] | None = None
    if provenance:
        from pyworker.lab import provenance as prov

        if progress is not None and task is not None:
            progress.update(task, description=f"{label}: provenance")
        cited = sources if judge == "citations" else record_sources(db, layout, "citations")
        measured = prov.measure(db, dsn, layout, conv, cited)
    questions = [q for q in conv.questions if q.evidence][:max_questions]
    if progress is not None and task is not None:
        progress.update(task, description=f"{label}: questions", completed=0,
                        total=len(questions))
    answers = []
    for q in questions:
        answers.append(ask(db, layout, q, sources, conv.name, judge))
        if progress is not None and task is not None:
            progress.advance(task)
    jobs = db.view_rows("job_status", workspace_id=layout.workspace)
    statuses: dict[str, int] = {}
    for j in jobs:
        key = f"{j['phase']} {j['status']}"
        statuses[key] = statuses.get(key, 0) + 1
    section: dict[str, Any] = {
        "conversation": conv.name, "variant": variant, "workspace": layout.workspace,
        "sessions": ingested.sessions, "requests": layout.requests, "messages": layout.messages,
        "questions_skipped_no_evidence": sum(1 for q in conv.questions if not q.evidence),
        "evidence_entries_dropped": conv.dropped_evidence,
        "store": store_facts(db, layout.workspace, sources, len(conv.turns)),
        "jobs": statuses,
        "seconds": {"ingest": round(ingested.ingest_seconds, 2),
                    "worker": round(ingested.worker_seconds, 2)},
        "latency_ms": {"recall": _ms([a.recall_ms for a in answers]),
                       "query_memories": _ms([a.query_ms for a in answers])},
        "scores": by_category(answers),
        "answers": [asdict(a) for a in answers],
    }
    if measured is not None:
        section["provenance"] = measured
    return section


def run(paths: Sequence[Path], adapter_name: str, variants: Sequence[locomo.Variant], *,
        dsn: str | None = None, server: str = "embedded", data_dir: Path,
        model: ModelRef, out_dir: Path | None = None, console: Console | None = None,
        max_questions: int | None = None, pi_models: Path | None = None,
        openai_base_url: str | None = None, plot: bool = True,
        judge: str = "api", provenance: bool = False) -> dict[str, Any]:
    """The whole eval; returns (and, with ``out_dir``, writes) the result."""
    console = console or Console()
    if adapter_name not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter_name!r}; choose one of {', '.join(ADAPTERS)}")
    if judge not in JUDGES:
        raise ValueError(f"unknown judge {judge!r}; choose one of {', '.join(JUDGES)}")
    conversations = locomo.load_all(paths)
    if not conversations:
        raise ValueError("no LoCoMo conversation found in the given paths")
    began = time.monotonic()
    sections: list[dict[str, Any]] = []
    all_answers: dict[str, list[Answer]] = {v: [] for v in variants}
    with eval_database(dsn, server, data_dir) as (target, where):
        db = Database(target, application_name="pimem-eval")
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, transient=True) as progress:
                for conv in conversations:
                    adapter = make_eval_adapter(adapter_name, conv, pi_models=pi_models,
                                                openai_base_url=openai_base_url)
                    try:
                        for variant in variants:
                            section = evaluate_conversation(db, target, conv, variant, adapter,
                                                            model, progress, max_questions,
                                                            judge, provenance)
                            sections.append(section)
                            all_answers[variant].extend(Answer(**a)
                                                        for a in section["answers"])
                    finally:
                        adapter.close()
        finally:
            db.close()
    result = {
        "tool": "pimem eval",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - began, 1),
        "adapter": adapter_name, "model": model.qualified, "database": where, "judge": judge,
        "variants": list(variants),
        "conversations": [c.name for c in conversations],
        "overall": {v: by_category(a) for v, a in all_answers.items()},
        "runs": sections,
    }
    render(result, console)
    if provenance:
        from pyworker.lab import provenance as prov

        prov.render(result, console)
    if out_dir is not None:
        write(result, out_dir, console, plot=plot)
    return result


# Output -----------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value * 100:.1f}"


def render(result: dict[str, Any], console: Console) -> None:
    """One table per variant (per category and overall), then one row per conversation; each
    reads at 80 columns (pyworker/terminal.py)."""
    tables = []
    for variant, cats in result["overall"].items():
        if not cats:
            continue  # no question asked (--questions 0)
        rows = [[f"[bold]{name}[/bold]" if name == "overall" else escape(name),
                 str(s["questions"]),
                 *[(f"{s[m]:.3f}" if m == "mrr" else _pct(s[m])) for m in METRICS]]
                for name, s in cats.items()]
        tables.append(fitted_table(
            f"pimem eval: {result['adapter']} adapter, {variant} variant, "
            f"{len(result['conversations'])} conversation(s) (% of questions)",
            ("category", "n", *METRICS), rows, right=range(1, len(METRICS) + 2)))
    rows = []
    for run_ in result["runs"]:
        s = run_["scores"].get("overall", {"questions": 0})
        st = run_["store"]
        rows.append([
            _stack(escape(run_["conversation"]), run_["variant"]),
            str(s["questions"]),
            _stack(f"recall {_pct(s.get('recall'))}", f"hit@5 {_pct(s.get('hit@5'))}",
                   f"coverage {_pct(s.get('coverage'))}"),
            _stack(f"{st['records']} records", f"{st['record_bytes']} bytes",
                   f"{_pct(st['turns_cited'])}% turns cited"),
            _stack(f"worker {run_['seconds']['worker']:.1f} s",
                   f"query p50 {run_['latency_ms']['query_memories'].get('p50', 0):.2f} ms")])
    tables.append(fitted_table("per conversation (% of questions)",
                               ("conversation", "n", "found", "memories", "time"), rows,
                               right=(1,)))
    emit(console, *tables)


def _stack(*lines: str) -> str:
    return "\n".join(lines)


def write(result: dict[str, Any], out_dir: Path, console: Console, *, plot: bool = True) -> None:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    wrote = ["eval.json"]
    if plot:
        try:
            draw(result, out_dir / "eval.png")
            wrote.append("eval.png")
        except ImportError:
            console.print("no plot: eval.png needs matplotlib, which the 'bench' extra installs: "
                          "pip install 'pimem[bench]' (in a checkout: pip install -e '.[bench]')",
                          markup=False, soft_wrap=True)
    console.print(f"wrote {', '.join(str(out_dir / w) for w in wrote)}")


def draw(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: the measures per category, one panel per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(result["overall"])
    fig, axes = plt.subplots(1, len(variants), figsize=(6.5 * len(variants), 4.2), squeeze=False)
    shown = [m for m in METRICS if m != "mrr"]
    for ax, variant in zip(axes[0], variants, strict=True):
        cats = result["overall"][variant]
        names = list(cats)
        width = 0.8 / len(shown)
        for i, m in enumerate(shown):
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, [cats[n][m] * 100 for n in names], width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels([f"{n}\n(n={cats[n]['questions']})" for n in names], fontsize=7)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of questions")
        ax.set_title(f"{variant} variant", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    fig.suptitle(f"pimem eval: {result['adapter']} adapter on "
                 f"{', '.join(result['conversations'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
