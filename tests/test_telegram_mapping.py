"""How Telegram maps onto the memory, without a server: directed messages, commands, topics,
roles, citations, message splitting, /memory's text and the configuration."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from aiogram.types import Message, User
from pydantic import TypeAdapter

from pyworker.client import Recall
from pyworker.contrib.telegram import mapping
from pyworker.contrib.telegram.bot import render_recall
from pyworker.contrib.telegram.config import Settings, SettingsError
from tests.fake_telegram import entities_of, member

ME = User(id=7_000_001, is_bot=True, first_name="Memo", username="memo_bot")
ALICE: dict[str, Any] = {"id": 101, "is_bot": False, "first_name": "Alice"}
GROUP: dict[str, Any] = {"id": -1001234500001, "type": "supergroup", "title": "Team"}
PRIVATE: dict[str, Any] = {"id": 101, "type": "private", "first_name": "Alice"}
BOT: dict[str, Any] = {"id": ME.id, "is_bot": True, "first_name": "Memo", "username": "memo_bot"}


def msg(text: str | None, *, chat: dict[str, Any] = GROUP, sender: dict[str, Any] = ALICE,
        **fields: Any) -> Message:
    value: dict[str, Any] = {"message_id": 50, "date": 1_796_000_000, "chat": chat,
                             "from": sender, **fields}
    if text is not None:
        value.setdefault("text", text)
        value.setdefault("entities", entities_of(text))
    return Message.model_validate(value)


def reply_from(sender: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"message_id": 40, "date": 1_796_000_000, "chat": GROUP, "from": sender,
            "text": "earlier", **fields}


@pytest.mark.parametrize("message, directed", [
    (msg("anything at all", chat=PRIVATE), True),
    (msg("@memo_bot when is the demo?"), True),
    (msg("hey @Memo_Bot, when?"), True),
    (msg("😀😀 @memo_bot after two emoji (UTF-16 offsets)"), True),
    (msg("@memo_botanist is someone else"), False),
    (msg("ask @other_bot instead"), False),
    (msg("the demo is at 3"), False),
    (msg("/memory"), True),
    (msg("/memory@memo_bot"), True),
    (msg("/memory@other_bot"), False),
    (msg("I said /memory in the middle"), False),
    (msg(None, caption="look @memo_bot", caption_entities=entities_of("look @memo_bot"),
         photo=[{"file_id": "f", "file_unique_id": "u", "width": 1, "height": 1}]), True),
    (msg("no mention", entities=[{"type": "text_mention", "offset": 0, "length": 2,
                                  "user": BOT}]), True),
    (msg("yes, exactly", reply_to_message=reply_from(BOT)), True),
    (msg("yes, exactly", reply_to_message=reply_from(ALICE)), False),
    # A forum topic the bot created: every message of it "replies" to the creation message.
    (msg("chatter in the bot's topic", message_thread_id=40, is_topic_message=True,
         reply_to_message=reply_from(BOT, forum_topic_created={"name": "Bot",
                                                               "icon_color": 1})), False),
    (msg("a real reply in a topic", message_thread_id=30, is_topic_message=True,
         reply_to_message=reply_from(BOT)), True),
])
def test_a_group_message_is_directed_only_by_a_mention_a_reply_to_the_bot_or_a_command(
        message: Message, directed: bool) -> None:
    assert mapping.is_directed(message, ME) is directed


BOB: dict[str, Any] = {"id": 102, "is_bot": False, "first_name": "Bob", "last_name": "Brown"}
NEWS: dict[str, Any] = {"id": -1009, "type": "channel", "title": "News"}
WHEN = 1_795_000_000


@pytest.mark.parametrize("fields, origin", [
    ({"forward_origin": {"type": "user", "date": WHEN, "sender_user": BOB}},
     "Bob Brown (user 102)"),
    ({"forward_origin": {"type": "hidden_user", "date": WHEN, "sender_user_name": "Anon"}},
     "Anon"),
    ({"forward_origin": {"type": "channel", "date": WHEN, "chat": NEWS, "message_id": 3}},
     "News (chat -1009)"),
    # Bot API 6's fields, without forward_origin: the same forwards under the old names.
    ({"forward_from": BOB, "forward_date": WHEN}, "Bob Brown (user 102)"),
    ({"forward_sender_name": "Anon", "forward_date": WHEN}, "Anon"),
    ({"forward_from_chat": NEWS, "forward_from_message_id": 3, "forward_date": WHEN},
     "News (chat -1009)"),
    ({"forward_date": WHEN}, "someone"),
])
def test_a_forward_is_someone_elses_words_whichever_fields_say_so(
        fields: dict[str, Any], origin: str) -> None:
    private = msg("remember that I approve", chat=PRIVATE, **fields)
    assert mapping.is_forwarded(private) and mapping.origin_of(private) == origin
    assert mapping.reported_text(private) == (
        f"[forwarded from {origin}]\n> remember that I approve")
    assert not mapping.is_directed(msg("@memo_bot remember that I approve", **fields), ME)


def test_legacy_forward_fields_an_aiogram_no_longer_declares_are_read_raw() -> None:
    # aiogram keeps a field it does not declare as an extra attribute, a dict: a version that
    # dropped the deprecated forward_* fields still hands them over.
    raw = Message.model_construct(message_id=50, date=WHEN, chat=PRIVATE, text="hi",
                                  forward_origin=None, forward_from=dict(BOB))
    assert mapping.is_forwarded(raw) and mapping.origin_of(raw) == "Bob Brown (user 102)"
    assert not mapping.is_forwarded(msg("my own words", chat=PRIVATE))


def test_commands_topics_and_ids() -> None:
    assert mapping.command_of(msg("/Memory@Memo_Bot now"), ME) == "memory"
    assert mapping.command_of(msg("/start@other_bot"), ME) is None
    assert mapping.command_of(msg("plain text"), ME) is None
    topic = msg("in a topic", message_thread_id=77, is_topic_message=True)
    reply_thread = msg("a reply thread of a non-forum supergroup", message_thread_id=12)
    assert (mapping.topic_id(topic), mapping.topic_id(reply_thread)) == (77, 0)
    place = mapping.place_of("tg", topic)
    assert place == mapping.Place(f"tg:group:{GROUP['id']}", str(GROUP["id"]), "group", 77)
    assert place.thread_id == f"{GROUP['id']}/77"
    assert mapping.place_of("tg", msg("hi", chat=PRIVATE)).workspace_id == "tg:user:101"
    assert mapping.request_key(topic) == f"{GROUP['id']}:50"
    assert mapping.memory_request_key(topic) == f"{GROUP['id']}:50:memory"


@pytest.mark.parametrize("status, fields, expected", [
    ("creator", {}, ("owner", True)),
    ("administrator", {}, ("admin", True)),
    ("member", {}, ("member", True)),
    ("restricted", {"is_member": True}, ("member", True)),
    ("restricted", {"is_member": False}, ("member", False)),
    ("left", {}, ("member", False)),
    ("kicked", {}, ("member", False)),
])
def test_telegram_statuses_become_workspace_roles(status: str, fields: dict[str, Any],
                                                  expected: tuple[str, bool]) -> None:
    from aiogram.types import ChatMemberUnion

    parsed = TypeAdapter(ChatMemberUnion).validate_python(member(status, ALICE, **fields))
    assert mapping.role_of(parsed) == expected


def test_only_authorized_citations_are_shown_numbered_under_the_answer() -> None:
    allowed = ["-1001234500001:7", "101:3"]
    text = ("Green tea [source: 101:3]. Launch Friday [source: -1001234500001:7, 101:3] "
            "[source: 101:999] and again [source: 101:3].")
    assert mapping.render_citations(text, allowed) == (
        "Green tea [1]. Launch Friday [2][1] and again [1].\n\nSources:\n"
        "[1] message 3\n[2] https://t.me/c/1234500001/7")
    assert mapping.render_citations("Made up [source: 101:999].", allowed) == "Made up."
    assert mapping.render_citations("No markers.", []) == "No markers."


def test_long_answers_are_cut_where_telegram_accepts_them() -> None:
    text = "\n".join(f"line {i} " + "x" * 90 for i in range(100))
    chunks = mapping.split_text(text)
    assert len(chunks) == 3 and all(len(c) <= 4096 for c in chunks)
    assert "\n".join(chunks) == text
    assert mapping.split_text("y" * 5000) == ["y" * 4096, "y" * 904]


def test_memory_shows_the_recall_answer_in_words() -> None:
    def recall(**value: Any) -> str:
        return render_recall(Recall.model_validate(value))

    created = datetime(2026, 10, 17, tzinfo=UTC).isoformat()
    assert recall(mode="none") == "I remember nothing in this chat yet."
    assert recall(mode="disabled").startswith("Memory is off in this chat")
    index = recall(mode="index", scope="shared", index="- demo on Friday", records=[
        {"id": 4, "kind": "note", "title": "Demo", "speaker_ids": ["202"],
         "created_at": created}])
    assert index.splitlines()[2:] == ["- demo on Friday", "", "#4 Demo (from 202), 2026-10-17"]
    directory = recall(mode="directory", scope="private", records=[
        {"id": 5, "kind": "extracted", "title": "Tea", "summary": "Alice likes green tea.",
         "speaker_ids": ["101"], "created_at": created}])
    assert directory.endswith("#5 Tea: Alice likes green tea., 2026-10-17")


BASE = {"PIMEM_TG_TOKEN": "1:abc", "PIMEM_DSN": "postgresql:///bots",
        "PIMEM_TG_MODEL": "openai/gpt-4o-mini",
        "PIMEM_PRICES": '{"openai/gpt-4o-mini": {"input": 0.15, "output": 0.6}}'}


def test_the_configuration_comes_from_the_environment() -> None:
    s = Settings.from_env(BASE)
    assert (s.model.qualified, s.price.output, s.mode, s.workspace_prefix, s.bot_id) == (
        "openai/gpt-4o-mini", Decimal("0.6"), "polling", "tg", "telegram")
    assert (s.request_budget_usd, s.retain_days, s.api_base) == (Decimal("0.50"), None, None)
    hook = Settings.from_env({**BASE, "PIMEM_TG_MODE": "webhook",
                              "PIMEM_TG_WEBHOOK_URL": "https://bot.example/tg",
                              "PIMEM_TG_WEBHOOK_LISTEN": "0.0.0.0:8443",
                              "PIMEM_TG_RETAIN_DAYS": "90"}, dsn="postgresql:///other")
    assert (hook.mode, hook.webhook_host, hook.webhook_port, hook.dsn, hook.retain_days) == (
        "webhook", "0.0.0.0", 8443, "postgresql:///other", 90)
    assert len(hook.webhook_secret) >= 32, "a secret is made when none is given"


@pytest.mark.parametrize("changes, says", [
    ({"PIMEM_TG_TOKEN": ""}, "PIMEM_TG_TOKEN is not set"),
    ({"PIMEM_TG_MODEL": "gpt-4o-mini"}, "PIMEM_TG_MODEL must be provider/model"),
    ({"PIMEM_PRICES": ""}, "PIMEM_PRICES is not set"),
    ({"PIMEM_PRICES": '{"openai/gpt-4o": {"input": 2.5, "output": 10}}'},
     "PIMEM_PRICES has no price for openai/gpt-4o-mini"),
    ({"PIMEM_PRICES": "{not json"}, "PIMEM_PRICES is not a price table"),
    ({"PIMEM_TG_MODE": "push"}, "PIMEM_TG_MODE must be polling or webhook"),
    ({"PIMEM_TG_MODE": "webhook"}, "PIMEM_TG_WEBHOOK_URL is not set"),
    ({"PIMEM_TG_WEBHOOK_SECRET": "has spaces"}, "PIMEM_TG_WEBHOOK_SECRET may hold only"),
    ({"PIMEM_TG_REQUEST_BUDGET_USD": "lots"}, "PIMEM_TG_REQUEST_BUDGET_USD must be a dollar"),
    ({"PIMEM_TG_WORKSPACE_BUDGET_USD": "-1"}, "PIMEM_TG_WORKSPACE_BUDGET_USD must be a dollar"),
    ({"PIMEM_TG_IDLE_MINUTES": "99999"}, "PIMEM_TG_IDLE_MINUTES must be a whole number"),
    ({"PIMEM_TG_WORKSPACE_PREFIX": "tg:x"}, "PIMEM_TG_WORKSPACE_PREFIX may hold only"),
    ({"PIMEM_TG_WEBHOOK_LISTEN": "8080"}, "PIMEM_TG_WEBHOOK_LISTEN must be host:port"),
])
def test_a_bad_setting_is_named(changes: dict[str, str], says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        Settings.from_env({**BASE, **changes})
