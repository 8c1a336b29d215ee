"""``pimem eval`` on a small LoCoMo-format conversation made for the tests (tests/data): the
dataset reader, how a two-person dialogue becomes requests, the replay adapter, the measures,
and the command."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pyworker.lab import evaluate, locomo
from pyworker.lab.replay import ReplayAdapter
from pyworker.payload import ExtractInput, Limits, ModelRef, Source

MINI = Path(__file__).parent / "data" / "locomo-mini.json"
# The limits a claim payload carries (memory_private.job_limits()).
LIMITS = Limits(summary_bytes=4000, title_bytes=300, index_bytes=4500, index_ids=12,
                batch_bytes=24000, candidates=48)
MODEL = ModelRef(provider="offline", id="heuristic")


def test_the_reader_normalises_turn_ids_evidence_captions_and_facts() -> None:
    [conv] = locomo.load(MINI)
    assert (conv.name, conv.speaker_a, conv.speaker_b) == ("mini-1", "Ana", "Ben")
    assert [s.number for s in conv.sessions] == [1, 2, 3]  # session 4 has a date, no turns
    photo = next(t for t in conv.turns if t.dia_id == "D1:6")
    assert photo.text.endswith("[shares a photo: a photo of a brown dog on a leash]")
    q = {x.question: x for x in conv.questions}
    assert q["Who will train with Ana for the marathon?"].evidence == ("D3:3", "D1:5")
    assert q["Did Ben go to the shelter on Sundays?"].evidence == ()  # names no turn
    assert conv.dropped_evidence == 1
    adopted = next(f for s in conv.sessions for f in s.facts if "adopted" in f.text)
    assert adopted.dia_ids == ("D2:1", "D1:6")
    assert locomo.dia_ids_in("D:11:26") == ["D11:26"]
    assert locomo.dia_ids_in(["D8:6; D9:17"]) == ["D8:6", "D9:17"]
    # Message ids sort in conversation order (the batch lists its sources by id).
    ids = [t.message_id for t in conv.turns]
    assert ids[0] == "D001:0001" and ids == sorted(ids)


def test_private_exchanges_pair_each_run_of_a_with_the_run_of_b_that_answers_it() -> None:
    [conv] = locomo.load(MINI)
    order = ["Ben", "Ana", "Ana", "Ben", "Ana", "Ben", "Ben", "Ana"]
    session = locomo.Session(9, "", tuple(locomo.Turn(f"D9:{i}", 9, who, f"t{i}")
                                          for i, who in enumerate(order, start=1)), ())
    groups = locomo.exchanges(conv, session)
    # The leading B turn opens the first exchange; the trailing A turn closes the last.
    assert [[t.dia_id for t in g] for g in groups] == [
        ["D9:1", "D9:2", "D9:3", "D9:4"], ["D9:5", "D9:6", "D9:7", "D9:8"]]


def test_replay_answers_with_the_facts_of_the_batch_sources_citing_them() -> None:
    [conv] = locomo.load(MINI)
    facts = locomo.facts_by_message(conv)
    # The session-2 fact that also names the session-1 photo is not known in session 1.
    assert "D001:0006" not in facts and "D002:0001" in facts
    batch = ExtractInput(sources=[
        Source(id="D002:0001", role="user", speaker_id="ben", text="..."),
        Source(id="D002:0001/ack", role="assistant", speaker_id="eval-bot", text="..."),
        Source(id="D002:0003", role="user", speaker_id="ben", text="...")])
    out = ReplayAdapter(facts).extract(batch, LIMITS)
    assert out["source_ids"] == ["D002:0001", "D002:0003"]
    lines = str(out["summary"]).splitlines()
    assert lines[:2] == ["- Ben adopted Biscuit, a brown dog from the shelter. [D002:0001]",
                         "- Biscuit hates the rain. [D002:0003]"]
    assert "replayed" in lines[-1] and out["title"]
    assert evaluate.cited_ids(str(out["summary"])) == ["D002:0001", "D002:0003"]
    empty = ExtractInput(sources=[Source(id="D003:0005", role="user", speaker_id="ana",
                                         text="Thanks")])
    assert ReplayAdapter(facts).extract(empty, LIMITS) == {
        "title": "", "summary": "", "source_ids": [], "reused_ids": []}


def quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def test_eval_ingests_each_variant_and_measures_every_question(db_dsn: str,
                                                                tmp_path: Path) -> None:
    result = evaluate.run([MINI], "replay", ["group", "private"], dsn=db_dsn,
                          data_dir=tmp_path, model=MODEL, out_dir=tmp_path / "out",
                          console=quiet(), judge="citations", plot=False)
    runs = {r["variant"]: r for r in result["runs"]}
    # group: one request per turn (the turn, and the bot's stand-in reply); private: one per
    # exchange, B's turns as the assistant's.
    assert (runs["group"]["requests"], runs["group"]["messages"]) == (16, 32)
    assert (runs["private"]["requests"], runs["private"]["messages"]) == (7, 16)
    for variant, run in runs.items():
        assert run["jobs"].get("extract succeeded") == 3, variant  # one batch per session
        assert run["questions_skipped_no_evidence"] == 1
        overall = run["scores"]["overall"]
        assert overall["questions"] == 11
        # The replayed facts rest on every questioned turn but the closing "Thanks" and the
        # photo of session 1 (only a fact of session 2 names it).
        assert overall["coverage"] == pytest.approx(9 / 11, abs=1e-4)
        assert overall["recall"] <= overall["coverage"]
        assert overall["hit@1"] <= overall["hit@5"] <= overall["hit@12"] <= overall["coverage"]
        assert overall["hit@5"] >= 0.7, overall
        assert run["store"]["records"] == 3
        for a in run["answers"]:
            assert (a["rank"] is not None) <= a["covered"]
            assert a["match"] in (None, "literal", "words", "fuzzy")
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["overall"]["group"]["overall"]["questions"] == 11
    assert saved["judge"] == "citations" and saved["adapter"] == "replay"


def test_the_command_runs_the_offline_model_and_says_when_it_cannot_plot(
        db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyworker.cli import app

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", str(MINI), "--dsn", db_dsn, "--out", str(out),
                                      "--questions", "4", "--provenance"])
    assert result.exit_code == 0, result.output
    assert "needs matplotlib" in result.output and "--provenance" in result.output
    saved = json.loads((out / "eval.json").read_text())
    assert saved["adapter"] == "offline" and saved["judge"] == "api"
    assert saved["runs"][0]["scores"]["overall"]["questions"] == 4
    assert saved["runs"][0]["provenance"]["mismatches"] == []
    bad = CliRunner().invoke(app, ["eval", str(MINI), "--dsn", db_dsn, "--variant", "dm"])
    assert bad.exit_code != 0 and "group, private or both" in bad.output


def test_the_eval_runs_a_model_adapter_through_the_worker(
        db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyworker.testing import FakeModel

    monkeypatch.setenv("PIMEM_PRICES", json.dumps({"fake/m": {"input": 3, "output": 15}}))
    monkeypatch.setenv("PIMEM_OPENAI_API_KEY", "fake-key")
    with FakeModel() as fake:
        result = evaluate.run([MINI], "openai", ["group"], dsn=db_dsn, data_dir=tmp_path,
                              model=ModelRef(provider="fake", id="m"), console=quiet(),
                              judge="citations", plot=False, openai_base_url=fake.url)
        assert fake.calls == 6 and fake.violations == []  # 3 extractions, 3 consolidations
    run = result["runs"][0]
    assert run["jobs"] == {"extract succeeded": 3, "consolidate succeeded": 3}
    # The fake cites every source of its batch: every questioned turn is covered.
    assert run["scores"]["overall"]["coverage"] == 1.0
    assert result["model"] == "fake/m"


def test_provenance_counts_match_removing_each_message_for_real(db_dsn: str,
                                                                tmp_path: Path) -> None:
    import psycopg

    result = evaluate.run([MINI], "offline", ["group"], dsn=db_dsn, data_dir=tmp_path,
                          model=MODEL, console=quiet(), max_questions=0, plot=False,
                          provenance=True)
    [run] = result["runs"]
    p = run["provenance"]
    ws = run["workspace"]
    assert p["mismatches"] == [] and all(w["as_expected"] for w in p["worked_removals"])
    # 16 turns, each with the bot's stand-in reply; the offline summaries cite turns only, but
    # every record rests on its whole batch: no message the model was shown is undepended.
    assert p["messages"] == 32 and p["messages_by_kind"]["reply"]["undepended"] == 0
    assert p["dependencies_by_via"]["shown"] >= 16
    assert p["invalidated_by_removal"]["max"] == 1, "each message is in one batch"
    assert p["records"] == p["records_valid"] == 3 and p["sources_are_cited_ids"] == 3
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "select message_id, array_agg(record_id order by record_id) "
            "from memory_private.record_dependencies where workspace_id = %s group by 1",
            (ws,)).fetchall()
        status = conn.execute("select sum(dependencies), sum(sources) from memory.record_status "
                              "where workspace_id = %s", (ws,)).fetchone()
        assert status is not None
        assert p["dependencies_per_record"]["mean"] == pytest.approx(int(status[0]) / 3, abs=0.01)
        assert p["sources_per_record"]["mean"] == pytest.approx(int(status[1]) / 3, abs=0.01)
        assert p["invalidated_by_message"] == {m: list(ids) for m, ids in rows}
        assert p["messages_undepended"] == 32 - len(rows)
        assert sum(p["invalidated_histogram"].values()) == 32
        # Removing for real (committed) agrees: the turn the report says invalidates records
        # makes exactly those records go at maintenance (every message was shown to a call, so
        # none is undepended).
        assert p["messages_undepended"] == 0
        held, gone = next(iter(p["invalidated_by_message"].items()))
        left = {r[0] for r in conn.execute(
            "select record_id from memory.record_status where workspace_id = %s and valid",
            (ws,))}
        assert len(left) == 3
        conn.execute("select memory.remove_message(%s, %s)", (ws, held))
        conn.execute("select memory.run_maintenance(%s)", (ws,))
        after = {r[0] for r in conn.execute(
            "select record_id from memory.record_status where workspace_id = %s", (ws,))}
        assert gone and after == left - set(gone)
