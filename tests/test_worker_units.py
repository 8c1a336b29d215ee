"""Unit tests of the worker's pieces that need no database: the claim payload, reading a reply
as one JSON object, the prompt builder, provider usage, and the offline summarizer."""

from __future__ import annotations

import json
import re
import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from pyworker.adapters.base import provider_usage
from pyworker.adapters.offline import NOTE, OfflineAdapter
from pyworker.payload import ClaimPayload, ReplyError, reply_object, utf8_len
from pyworker.prompting import build_prompt

LIMITS = {"summary_bytes": 4000, "title_bytes": 300, "index_bytes": 4500, "index_ids": 12,
          "batch_bytes": 24000, "candidates": 48}


def payload(phase: str = "extract", limits: dict[str, int] | None = None,
            **input_: Any) -> ClaimPayload:
    if phase == "extract":
        input_ = input_ or {"sources": [
            {"id": "m1", "role": "user", "speaker_id": "alice", "thread_id": "t1",
             "created_at": "2026-01-01T10:00:00Z",
             "text": "Please draft the release notes. I prefer bullet points, always."},
            {"id": "m2", "role": "assistant", "speaker_id": "bot1", "thread_id": "t1",
             "created_at": "2026-01-01T10:00:05Z", "text": "Here is a draft."},
            {"id": "m3", "role": "user", "speaker_id": "alice", "thread_id": "t1",
             "created_at": "2026-01-01T10:01:00Z",
             "text": "Actually, the version is 2.1 not 2.0. We still need the changelog later. "
                     "My token is [REDACTED]."},
        ], "existing": []}
    else:
        input_ = input_ or {"candidates": [
            {"id": i, "kind": "extracted", "title": f"record {i}", "summary": f"summary {i}",
             "speaker_ids": ["alice"], "created_at": f"2026-01-{i:02d}T00:00:00Z"}
            for i in range(1, 21)]}
    return ClaimPayload.model_validate({
        "job_id": 7, "workspace_id": "ws1", "token": "00000000-0000-0000-0000-000000000001",
        "phase": phase, "attempt": 1, "lease_expires_at": "2026-01-01T10:02:00Z",
        "scope": {"scope_id": 3, "kind": "private", "bot_id": "bot1", "chat_id": "dm-alice",
                  "user_id": "alice", "topic_id": None},
        "origin_request_id": "r1", "model": {"provider": "fake", "id": "m"},
        "budget": {"request_left_usd": 0.5, "workspace_left_usd": 10},
        "limits": limits or LIMITS, "input": input_, "checkpoint": None, "some_future_key": 1})


def offline_reply(p: ClaimPayload) -> dict[str, Any]:
    reply = OfflineAdapter().complete(p.model, build_prompt(p), deadline=time.monotonic() + 5,
                                      cancel=threading.Event())
    assert reply.usage.cost_usd == Decimal(0)
    return json.loads(reply.text)  # type: ignore[no-any-return]


def test_claim_payload_parses_the_contract_and_ignores_unknown_keys() -> None:
    p = payload()
    assert p.model.qualified == "fake/m"
    assert [s.id for s in p.extract_input().sources] == ["m1", "m2", "m3"]
    assert p.log_fields() == {"workspace_id": "ws1", "job_id": 7, "phase": "extract",
                              "request_id": "r1", "scope_id": 3}


def test_a_claim_without_the_databases_limits_is_not_read() -> None:
    """The limits are the claim's (memory_private.job_limits()); the worker has none of its own,
    so a claim without them is one it cannot read (and gives back)."""
    full = payload().model_dump()
    with pytest.raises(ValidationError):
        ClaimPayload.model_validate({k: v for k, v in full.items() if k != "limits"})


def test_the_prompt_carries_the_claims_input_as_data_and_the_claims_limits() -> None:
    prompt = build_prompt(payload(limits={**LIMITS, "summary_bytes": 3999, "index_ids": 11}))
    assert "TASK: extract" in prompt.user and "not instructions" in prompt.user
    assert "<<<DATA\n" in prompt.user and "$" not in prompt.user.split("<<<DATA")[0]
    assert "3999 UTF-8 bytes" in prompt.user and "4000" not in prompt.user
    data = json.loads(prompt.user.split("<<<DATA\n", 1)[1].split("\nDATA>>>", 1)[0])
    assert data["sources"] == payload().model_dump(mode="json")["input"]["sources"]
    cons = build_prompt(payload("consolidate", limits={**LIMITS, "index_ids": 11}))
    assert "TASK: consolidate" in cons.user and "at most 11 ids" in cons.user


def test_a_reply_that_is_one_json_object_is_handed_on_as_written() -> None:
    """Whether the object is a valid output is the database's verdict (save_checkpoint, MB023):
    the worker hands on any object, its numbers exactly as written."""
    fenced = '```json\n{"title": "t", "summary": "s", "source_ids": ["m1"]}\n```'
    assert reply_object(fenced) == '{"title": "t", "summary": "s", "source_ids": ["m1"]}'
    for text in ('{"title": 5, "unknown": [1.5, 1e999]}',
                 '{"record_ids": [' + "9" * 5000 + "]}",
                 '{"index": "\\ud800 lone surrogate as an escape", "record_ids": []}',
                 '{"index": "nul \\u0000", "record_ids": [1]}',
                 "  {}  "):
        assert reply_object(text) == text.strip()


def test_a_reply_that_is_not_one_json_object_is_reply_not_json() -> None:
    for text in ("not json at all", '["a list"]', '"a string"', "", "```json\n```",
                 '{"title": NaN}', '{"title": Infinity}', '{"a": 1} {"b": 2}',
                 json.dumps(json.dumps({"title": "double encoded"})),
                 "[" * 100_000 + "]" * 100_000,
                 '{"title": "\ud800 a lone surrogate character"}'):
        with pytest.raises(ReplyError) as err:
            reply_object(text)
        assert err.value.code == "reply_not_json"


def test_provider_usage_keeps_every_number_and_drops_what_is_not_one() -> None:
    """Whether a count or cost is in range is the database's to say (check_usage, MB001)."""
    usage = provider_usage(-5, 10**12, "0.5")
    assert (usage.input_tokens, usage.output_tokens, usage.cost_usd) == (-5, 10**12, None)
    assert provider_usage(1200.0, 1200.5, 2_000_000).as_json() == {
        "input_tokens": 1200, "output_tokens": 1200.5, "cost_usd": 2_000_000.0}
    for not_a_number in (float("nan"), float("inf"), True, None, "12", [1]):
        assert provider_usage(not_a_number, 1, 1).known is False


def test_offline_extraction_picks_requests_corrections_preferences_and_open_items() -> None:
    p = payload()
    out = offline_reply(p)
    summary = out["summary"]
    assert "- request: alice: Please draft the release notes." in summary
    assert "- correction: alice: Actually, the version is 2.1 not 2.0." in summary
    assert "- preference: alice: I prefer bullet points, always." in summary
    assert "- open item: alice: We still need the changelog later." in summary
    assert summary.index("request") < summary.index("correction") < summary.index("open item")
    assert summary.endswith(NOTE)
    assert out["source_ids"] == ["m1", "m3"]
    # The title says what the record is about: its speaker and its main words.
    assert out["title"].startswith("alice: ") and "release" in out["title"]


def test_offline_extraction_understands_chinese_and_is_a_noop_on_small_talk() -> None:
    p = payload(sources=[
        {"id": "c1", "role": "user", "speaker_id": "wang", "text": "我们决定用 PostgreSQL。"},
        {"id": "c2", "role": "user", "speaker_id": "wang", "text": "不对，应该是周五发布。"},
        {"id": "c3", "role": "user", "speaker_id": "wang", "text": "我更喜欢简短的回答。"},
        {"id": "c4", "role": "user", "speaker_id": "wang", "text": "测试报告还没写完。"}],
        existing=[])
    out = offline_reply(p)
    for kind in ("decision: wang: 我们决定用", "correction: wang: 不对", "preference: wang: 我更喜欢",
                 "open item: wang: 测试报告还没写完"):
        assert kind in out["summary"]
    small = payload(sources=[{"id": "s1", "role": "user", "speaker_id": "a", "text": "hi there"},
                             {"id": "s2", "role": "assistant", "speaker_id": "b",
                              "text": "hello"}], existing=[])
    assert offline_reply(small) == {"title": "", "summary": "", "source_ids": [],
                                    "reused_ids": []}


def test_offline_extraction_stays_within_the_byte_limit() -> None:
    long = "Please remember that I prefer " + "très longues réponses " * 40 + "."
    p = payload(sources=[{"id": f"x{i}", "role": "user", "speaker_id": "a", "text": long}
                         for i in range(30)], existing=[])
    out = offline_reply(p)
    assert utf8_len(out["summary"]) <= 4000 and utf8_len(out["title"]) <= 300
    assert set(out["source_ids"]) <= {f"x{i}" for i in range(30)} and out["source_ids"]


def test_offline_consolidation_indexes_the_newest_12_among_equals() -> None:
    p = payload("consolidate")
    out = offline_reply(p)
    assert out["record_ids"] == list(range(20, 8, -1))
    assert out["index"].splitlines()[0] == "[#20] record 20 (extracted; alice)"
    assert utf8_len(out["index"]) <= 4500


def test_offline_consolidation_prefers_records_of_standing_value_over_the_newest() -> None:
    chatter = [{"id": i, "kind": "extracted", "title": f"chat {i}",
                "summary": "- request: alice: Please say hi. [m]",
                "speaker_ids": ["alice"], "created_at": f"2026-02-{i:02d}T00:00:00Z"}
               for i in range(1, 15)]
    lasting = [
        {"id": 20, "kind": "extracted", "title": "tea", "speaker_ids": ["alice"],
         "created_at": "2026-01-01T00:00:00Z",
         "summary": "- preference: alice: I prefer green tea. [m1]\n"
                    "- decision: alice: We decided to meet on Fridays. [m2]"},
        {"id": 21, "kind": "note", "title": "remembered", "speaker_ids": ["alice"],
         "created_at": "2026-01-02T00:00:00Z", "summary": "My birthday is on 3 May."},
        # A model's summary, without the offline labels: its sentences are read instead.
        {"id": 22, "kind": "extracted", "title": "plans", "speaker_ids": ["bob"],
         "created_at": "2026-01-03T00:00:00Z",
         "summary": "Bob is going to move to Lisbon in March. He decided to sell his car."}]
    p = payload("consolidate", candidates=chatter + lasting)
    out = offline_reply(p)
    assert out["record_ids"][:3] == [21, 20, 22]  # the note, then the most lasting content
    assert out["record_ids"][3:] == list(range(14, 5, -1))  # then the newest
    assert out["index"].splitlines()[0].startswith("[#21] remembered (note; alice)")
    assert json.loads(reply_object(json.dumps(out))) == out


def test_worker_refuses_to_start_without_pi_rather_than_failing_every_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from pyworker.cli import app

    monkeypatch.setenv("PIMEM_PI_BIN", "/nonexistent/pi")
    result = CliRunner().invoke(app, ["worker", "--dsn", "host=/nonexistent", "--model", "pi"])
    assert result.exit_code == 2 and "Pi CLI is not installed" in result.output
    bad = CliRunner().invoke(app, ["worker", "--dsn", "not a dsn", "--model", "offline"])
    assert bad.exit_code == 2 and "not a connection string" in bad.output


def test_offline_extraction_keeps_facts_and_leaves_out_small_talk_and_empty_questions() -> None:
    turns = [
        ("t1", "Hey Mel! Good to see you! How have you been?"),
        ("t2", "I went to a LGBTQ support group yesterday and it was so powerful."),
        ("t3", "Wow, that's great!"),
        ("t4", "My sister Marta moved to Lisbon in 2019 for her new job."),
        ("t5", "What did you think of it?"),
        ("t6", "I'm going to run the Porto half marathon in October."),
    ]
    p = payload(sources=[{"id": i, "role": "user", "speaker_id": "caroline", "text": t}
                         for i, t in turns], existing=[])
    out = offline_reply(p)
    assert json.loads(reply_object(json.dumps(out))) == out
    summary = out["summary"]
    assert out["source_ids"] == ["t6", "t2", "t4"]  # the plan first (P7), then the facts
    assert "- plan: caroline: I'm going to run the Porto half marathon in October. [t6]" in summary
    assert "- fact: caroline: I went to a LGBTQ support group yesterday" in summary
    assert "- fact: caroline: My sister Marta moved to Lisbon in 2019" in summary
    for left_out in ("Good to see you", "Wow", "What did you think"):
        assert left_out not in summary
    assert out["title"].startswith("caroline: ")


def summary_lines(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(kind, speaker, what was said, cited id) of each line of an offline summary."""
    lines = out["summary"].splitlines()
    assert lines[-1] == NOTE
    parsed = []
    for line in lines[:-1]:
        m = re.fullmatch(r"- ([a-z ]+): (\S+): (.+) \[([^\]]+)\]", line)
        assert m, line
        parsed.append((m[1], m[2], m[3], m[4]))
    return parsed


def test_offline_extraction_keeps_every_statement_of_each_speaker_and_no_small_talk() -> None:
    """A group topic: two people, each turn a request of its own with the bot's stand-in reply.
    Every sentence that states something is kept, attributed and cited by its own turn, even
    with a single mark of a fact; greetings, thanks, reactions, asides and empty questions
    are not."""
    turns = [
        ("g1", "caroline", "Hey Mel! How have you been?"),
        ("g2", "melanie", "I'm considering getting a dog."),
        ("g3", "caroline", "Wow, that's great! Thanks, Mel!"),
        ("g4", "melanie", "It was in London."),
        ("g5", "caroline", "Pottery is such a calming hobby for anyone who paints."),
        ("g6", "melanie", "I got married! (laughs)"),
        ("g7", "caroline", "Congrats! What did you think of it?"),
        ("g8", "melanie", "Did Jon paint that mural in Porto in 2019?"),
    ]
    sources: list[dict[str, str]] = []
    for mid, who, text in turns:
        sources.append({"id": mid, "role": "user", "speaker_id": who, "text": text})
        sources.append({"id": f"{mid}/ack", "role": "assistant", "speaker_id": "bot1",
                        "text": "(the bot's reply is not part of the dataset)"})
    out = offline_reply(payload(sources=sources, existing=[]))
    assert json.loads(reply_object(json.dumps(out))) == out
    assert summary_lines(out) == [
        ("fact", "melanie", "I'm considering getting a dog.", "g2"),
        ("fact", "melanie", "It was in London.", "g4"),
        ("fact", "caroline", "Pottery is such a calming hobby for anyone who paints.", "g5"),
        ("fact", "melanie", "I got married!", "g6"),
        # A question that carries a fact (a name, a place, a date) states something.
        ("fact", "melanie", "Did Jon paint that mural in Porto in 2019?", "g8"),
    ]
    assert out["source_ids"] == ["g2", "g4", "g5", "g6", "g8"]
    assert out["title"].startswith("melanie and caroline: ")


def test_offline_extraction_keeps_the_assistant_sides_statements_too() -> None:
    """A private chat where the assistant side is another person's words (the eval's private
    variant): what it states is kept and attributed to it; its "we decided" is a proposal, and
    it makes no requests."""
    p = payload(sources=[
        {"id": "a1", "role": "user", "speaker_id": "alice", "text": "Hi! How was your week?"},
        {"id": "a2", "role": "assistant", "speaker_id": "bot1",
         "text": "Great, thanks! I adopted a beagle puppy called Max on Saturday. "
                 "Can you believe it?"},
        {"id": "a3", "role": "user", "speaker_id": "alice",
         "text": "Aww, so cute! My cat Luna would hate him."},
        {"id": "a4", "role": "assistant", "speaker_id": "bot1",
         "text": "We decided to move to Lisbon next spring. Please send me photos of Luna."},
        {"id": "a5", "role": "assistant", "speaker_id": "bot1", "text": "Haha, sure thing!"},
    ], existing=[])
    out = offline_reply(p)
    assert summary_lines(out) == [
        ("fact", "bot1", "I adopted a beagle puppy called Max on Saturday.", "a2"),
        ("fact", "alice", "My cat Luna would hate him.", "a3"),
        ("fact", "bot1", "Please send me photos of Luna.", "a4"),
        ("proposal", "bot1", "We decided to move to Lisbon next spring.", "a4"),
    ]
    assert out["source_ids"] == ["a2", "a3", "a4"]


def test_offline_extraction_states_each_sentence_once_and_not_what_memories_say() -> None:
    said = "My brother Tom opened a bakery in Leeds in 2021."
    p = payload(sources=[
        {"id": "d1", "role": "user", "speaker_id": "alice", "text": said},
        {"id": "d2", "role": "user", "speaker_id": "alice", "text": said},
        {"id": "d3", "role": "user", "speaker_id": "alice",
         "text": f"{said} I started running with my neighbour Priya."},
        # The same words from another speaker are that speaker's statement.
        {"id": "d5", "role": "assistant", "speaker_id": "bot1", "text": said},
        {"id": "d4", "role": "user", "speaker_id": "alice",
         "text": "We painted the kitchen yellow over the weekend."},
    ], existing=[{"id": 5, "title": "alice: kitchen",
                  "summary": "- fact: alice: We painted the kitchen yellow over the weekend. "
                             "[x1]"}])
    out = offline_reply(p)
    assert summary_lines(out) == [
        ("fact", "alice", said, "d1"),
        ("fact", "alice", "I started running with my neighbour Priya.", "d3"),
        ("fact", "bot1", said, "d5"),
    ]


def test_offline_extraction_understands_chinese_statements_and_small_talk() -> None:
    p = payload(sources=[
        {"id": "z1", "role": "user", "speaker_id": "wang", "text": "你好！谢谢！"},
        {"id": "z2", "role": "assistant", "speaker_id": "li", "text": "我上周在杭州买了一辆自行车。"},
        {"id": "z3", "role": "user", "speaker_id": "wang", "text": "哈哈，好的。"},
    ], existing=[])
    out = offline_reply(p)
    assert summary_lines(out) == [("fact", "li", "我上周在杭州买了一辆自行车。", "z2")]


def test_offline_extraction_says_at_most_600_bytes_of_a_turn() -> None:
    """A long answer does not fill a record: its line says its most specific sentences, up to
    600 bytes, and the rest of the batch is kept whole."""
    answer = " ".join(f"Step {i}: the Lisbon office moves desk {i} to floor {i % 7}."
                      for i in range(40))
    p = payload(sources=[
        {"id": "l1", "role": "user", "speaker_id": "alice",
         "text": "I moved to the Lisbon office in March. My desk is by the window."},
        {"id": "l2", "role": "assistant", "speaker_id": "bot1", "text": answer}], existing=[])
    out = offline_reply(p)
    lines = summary_lines(out)
    assert lines[0] == ("fact", "alice", ("I moved to the Lisbon office in March. "
                        "My desk is by the window."), "l1")
    kind, speaker, said, mid = lines[1]
    assert (kind, speaker, mid) == ("fact", "bot1", "l2") and said in answer
    assert 550 < utf8_len(said) <= 600 and utf8_len(out["summary"]) < 1000


def test_offline_extraction_over_budget_keeps_each_turns_most_specific_sentence_first() -> None:
    """When the statements do not all fit, every turn first keeps its most specific sentence
    (the most marks of a fact), then the others go in by the same order; the summary stays
    within the limit and each line still cites its own turn."""
    rich = "I moved to Lisbon with my sister {} in May {}."  # four marks
    plain = "The weather there was rather grey and windy for {} days."  # two
    sources = [{"id": f"p{i:03d}", "role": "user" if i % 3 else "assistant",
                "speaker_id": "alice" if i % 3 else "bot1",
                "text": f"{plain.format(i)} {rich.format(f'Marta{i}', 1900 + i)}"}
               for i in range(60)]
    limits = {**LIMITS, "summary_bytes": 4000}
    out = offline_reply(payload(sources=sources, existing=[], limits=limits))
    assert utf8_len(out["summary"]) <= 4000
    lines = summary_lines(out)
    texts = {s["id"]: s["text"] for s in sources}
    cited = [mid for _, _, _, mid in lines]
    assert out["source_ids"] == cited and len(cited) == len(set(cited))
    for _, speaker, said, mid in lines:
        assert rich.split(" {}")[0] in said and said in texts[mid]
        assert speaker == ("bot1" if int(mid[1:]) % 3 == 0 else "alice")
    # The rich sentence of every turn that fits comes before any plain one: either every line
    # holds only its rich sentence, or every turn is there.
    assert len(lines) < len(sources)  # the limit bites here: 60 turns do not fit in 4,000 bytes
    assert not [said for _, _, said, _ in lines if plain.split(" {}")[0] in said]
    # Among equals, the user's turns go in before the assistant's, then the earlier.
    assistant = [int(m[1:]) for m in cited if int(m[1:]) % 3 == 0]
    assert [int(m[1:]) for m in cited if int(m[1:]) % 3] == [i for i in range(60) if i % 3]
    assert 0 < len(assistant) < 20 and assistant == list(range(0, 3 * len(assistant), 3))
    # The turns of fewest marks are the ones left out (the later among equals).
    alone = [{"id": f"q{i:03d}", "role": "user", "speaker_id": "alice",
              "text": plain.format(i) if i % 2 else rich.format(f"Marta{i}", 1900 + i)}
             for i in range(80)]
    out = offline_reply(payload(sources=alone, existing=[], limits=limits))
    assert utf8_len(out["summary"]) <= 4000
    kept = [int(i[1:]) for i in out["source_ids"]]
    plain_kept = [i for i in kept if i % 2]
    assert [i for i in kept if i % 2 == 0] == list(range(0, 80, 2))
    assert 0 < len(plain_kept) < 40 and plain_kept == list(range(1, 2 * len(plain_kept), 2))
    # With room for all, all is kept, in conversation order, each line in its turn's order of
    # sentences.
    roomy = offline_reply(payload(sources=sources[:6], existing=[], limits=limits))
    assert [said for _, _, said, _ in summary_lines(roomy)] == [
        s["text"] for s in sources[:6]]
