"""The reference Telegram bot end to end, with no network: aiogram talks to a fake Bot API on
127.0.0.1, the chat model is a fake OpenAI-compatible server with function calling, memories are
made by the real worker (through the fake extraction model) in a real PostgreSQL, and the bot
runs in-process exactly as ``pimem telegram`` runs it (test_telegram_cli.py runs the command)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from decimal import Decimal

import httpx
import psycopg
import pytest

from tests.fake_chat import NEVER_SHOWN, FakeChat, scripted_model
from tests.fake_telegram import JsonDict
from tests.telegram_world import CALL_COST, World, telegram_world

GROUP = -1001234500001
PRIVATE_WS = "tg:user:101"
GROUP_WS = f"tg:group:{GROUP}"


@pytest.fixture
def world(conn: psycopg.Connection, db_dsn: str) -> Iterator[World]:
    with telegram_world(conn, db_dsn) as w:
        yield w


def people(world: World) -> tuple[JsonDict, JsonDict, JsonDict]:
    tg = world.tg
    return tg.user(101, "Alice", "alice"), tg.user(201, "Olga", "olga"), tg.user(202, "Bob")


def team(world: World, *, forum: bool = False, bot_status: str = "member") -> JsonDict:
    """A supergroup with Olga as its creator and Bob as a member; the bot is added."""
    _, olga, bob = people(world)
    group = world.tg.group(GROUP, "Team", forum=forum)
    world.tg.set_member(group, olga, "creator")
    world.tg.set_member(group, bob, "member")
    world.deliver(world.tg.bot_update(group, bot_status, by=olga))
    return group


def header_of(world: World) -> JsonDict:
    """The JSON line that describes the current message to the model (its last call)."""
    user = next(m for m in world.chat.requests[-1]["messages"] if m["role"] == "user")
    return dict(json.loads(user["content"].split("\n", 1)[0]))


def request_row(world: World, request_id: str, ws: str = PRIVATE_WS) -> dict[str, object]:
    [row] = world.rows("select status, spent_usd, thread_id, topic_id, user_id "
                       "from memory_private.requests where workspace_id = %s "
                       "and request_id = %s", ws, request_id)
    return row


def test_a_private_preference_is_remembered_after_the_idle_window_and_shapes_the_next_answer(
        world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    first = world.say(dm, alice, "I prefer answers in German. Where should we eat tonight?")
    assert world.last_answer().startswith("You said:"), "nothing is remembered yet"
    assert world.memory_given() == {"mode": "none"}
    assert world.make_memories() == 2, "one extraction, one consolidation"
    index = world.value("select index_text from memory_private.scope_indexes "
                        "where workspace_id = %s",
                        PRIVATE_WS)
    assert "I prefer answers in German" in index

    world.say(dm, alice, "And tomorrow?")
    given = world.memory_given()
    assert given["mode"] == "index" and "I prefer answers in German" in given["index"]
    assert given["label"].startswith("Historical reference data")
    assert world.last_answer().startswith("Following your preference for answers in German")
    # One request per answer, each with its thread (the chat and topic) and its spend.
    assert request_row(world, f"101:{first['message_id']}") == {
        "status": "succeeded", "spent_usd": CALL_COST, "thread_id": "101/0", "topic_id": 0,
        "user_id": "101"}
    roles = world.rows("select role, speaker_id from memory_private.messages "
                       "where workspace_id = %s order by created_at, role desc", PRIVATE_WS)
    assert [r["role"] for r in roles] == ["user", "assistant", "user", "assistant"]
    assert world.tg.violations == []


def test_a_forum_topic_stores_only_directed_messages_and_topics_never_mix(world: World) -> None:
    tg = world.tg
    _, olga, bob = people(world)
    group = team(world, forum=True)
    release = tg.create_topic(group, olga, "Release")
    design = tg.create_topic(group, olga, "Design")
    world.deliver(tg.updates[-1])
    world.say(group, bob, "between us: the staging password is hunter2", topic=release)
    world.say(group, bob, "@memo_bot the release train leaves on Thursday", topic=release)
    answer = tg.sent[-1]
    assert "in_reply_to" not in header_of(world), "a topic's creation message is no reply"
    world.say(group, bob, "and the retro is on Friday", topic=release, reply_to=answer)
    assert header_of(world)["in_reply_to"] == {
        "message_id": f"{GROUP}:{answer['message_id']}", "from": "you (the bot)",
        "text": answer["text"]}
    world.say(group, olga, "@memo_bot we paint the logo blue", topic=design)
    world.say(group, olga, "/memory@other_bot", topic=design)

    stored = world.rows("select body, request_id from memory_private.messages "
                        "where workspace_id = %s and role = 'user' order by created_at",
                        GROUP_WS)
    assert [m["body"] for m in stored] == [
        "@memo_bot the release train leaves on Thursday", "and the retro is on Friday",
        "@memo_bot we paint the logo blue"]
    assert not any("hunter2" in str(body) for body in world.chat.requests), \
        "ordinary group traffic never reaches the model either"
    assert [(m.get("message_thread_id"), m["reply_to_message"]["message_id"])
            for m in tg.sent] == [(release, answer["reply_to_message"]["message_id"]),
                                  (release, tg.updates[-3]["message"]["message_id"]),
                                  (design, tg.updates[-2]["message"]["message_id"])]
    topics = world.rows("select request_id, topic_id, thread_id from memory_private.requests "
                        "where workspace_id = %s order by created_at", GROUP_WS)
    assert [(t["topic_id"], t["thread_id"]) for t in topics] == [
        (release, f"{GROUP}/{release}"), (release, f"{GROUP}/{release}"),
        (design, f"{GROUP}/{design}")]

    world.make_memories()
    world.say(group, bob, "@memo_bot what did we decide?", topic=design)
    in_design = str(world.memory_given())
    assert "paint the logo blue" in in_design and "release train" not in in_design
    world.say(group, bob, "@memo_bot what did we decide?", topic=release)
    in_release = str(world.memory_given())
    assert "release train" in in_release
    assert "logo" not in in_release
    world.say(group, bob, "@memo_bot what did we decide?")
    assert world.memory_given() == {"mode": "none"}, "the general topic is topic 0, its own scope"
    scopes = world.rows("select topic_id from memory_private.scopes where workspace_id = %s "
                        "order by topic_id", GROUP_WS)
    assert [s["topic_id"] for s in scopes] == [0, release, design]


def test_a_member_may_remember_but_only_an_admin_turns_group_memory_off(world: World) -> None:
    _, olga, bob = people(world)
    group = team(world)
    world.say(group, bob, "@memo_bot remember that the demo is at 3pm on Friday")
    assert "Saved the message as memory" in world.last_answer()
    [note] = world.rows("select kind, summary, speaker_ids from memory_private.records "
                        "where workspace_id = %s", GROUP_WS)
    assert note == {"kind": "note", "summary": "@memo_bot remember that the demo is at 3pm "
                    "on Friday", "speaker_ids": ["202"]}
    [(name, args, _)] = world.chat.tool_calls()
    assert (name, args["action"], args["sourceId"]) == (
        "manage_memory", "remember", f"{GROUP}:{world.tg.updates[-1]['message']['message_id']}")

    world.say(group, bob, "@memo_bot turn memory off")
    assert "Only an active workspace owner or admin" in world.last_answer()
    assert world.value("select recall_enabled from memory_private.scopes "
                       "where workspace_id = %s", GROUP_WS) is True
    world.say(group, olga, "@memo_bot turn memory off")
    assert "Memory is off in this chat" in world.last_answer()
    assert world.value("select recall_enabled from memory_private.scopes "
                       "where workspace_id = %s", GROUP_WS) is False
    world.say(group, bob, "/memory")
    assert world.last_answer().startswith("Memory is off in this chat")
    world.say(group, bob, "@memo_bot when is the demo?")
    assert world.memory_given() == {"mode": "disabled"}


def test_forget_removes_the_memory_the_tool_found(world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    tea = world.say(dm, alice, "remember that I like green tea")
    world.say(dm, alice, "remember that my cat is called Miso")
    notes = {r["summary"]: r["record_id"] for r in world.rows(
        "select record_id, summary from memory_private.records where workspace_id = %s",
        PRIVATE_WS)}
    world.say(dm, alice, "forget what you know about green tea")
    calls = world.chat.tool_calls()
    (query, q_args, _), (forget, f_args, _) = calls[-2:]
    assert (query, q_args) == ("query_memories", {"query": "green tea"})
    assert (forget, f_args["memoryId"]) == ("manage_memory",
                                            notes["remember that I like green tea"])
    assert "forgot" in world.last_answer().lower() or "forgotten" in world.last_answer().lower()
    left = world.rows("select summary from memory_private.records where workspace_id = %s",
                      PRIVATE_WS)
    assert [r["summary"] for r in left] == ["remember that my cat is called Miso"]
    assert world.value("select count(*) from memory_private.tombstones where workspace_id = %s "
                       "and message_id = %s", PRIVATE_WS, f"101:{tea['message_id']}") == 1
    world.say(dm, alice, "/memory")
    assert "Miso" in world.last_answer() and "green tea" not in world.last_answer()


def test_the_answer_shows_only_the_citations_the_database_authorizes(world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    tea = world.say(dm, alice, "remember that I like green tea")
    world.say(dm, alice, "what do you know about green tea?")
    model_text = world.chat.requests[-1]["messages"]
    assert NEVER_SHOWN not in str(model_text[-1]), "the fake cites it only in its answer"
    answer = world.last_answer()
    assert answer.endswith(f"Sources:\n[1] message {tea['message_id']}")
    assert "[1]" in answer.split("\n")[0] and NEVER_SHOWN not in answer
    assert "source:" not in answer.lower()
    [stored] = world.rows("select body from memory_private.messages where workspace_id = %s "
                          "and role = 'assistant' order by created_at desc limit 1", PRIVATE_WS)
    assert stored["body"] == answer, "the answer is stored as the user saw it"


def test_an_edit_invalidates_the_memory_built_on_the_old_text(world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    said = world.say(dm, alice, "I prefer answers in German.")
    world.make_memories()
    [record] = world.rows("select record_id from memory_private.records "
                          "where workspace_id = %s", PRIVATE_WS)
    world.deliver(world.tg._push({"edited_message": {**said, "text": "I prefer answers in French.",
                                                     "edit_date": said["date"] + 60}}))
    assert world.value("select body from memory_private.messages where workspace_id = %s "
                       "and message_id = %s", PRIVATE_WS, f"101:{said['message_id']}") == \
        "I prefer answers in French."
    reason = world.value("select memory_private.record_invalid_reason(row(r.*)::"
                         "memory_private.records, '101') from memory_private.records r "
                         "where workspace_id = %s and record_id = %s", PRIVATE_WS,
                         record["record_id"])
    assert reason == "source_edited"
    world.say(dm, alice, "/memory")
    assert world.last_answer() == "I remember nothing in this chat yet."
    world.say(dm, alice, "Good morning")
    assert world.last_answer().startswith("You said:"), "the German preference is gone"

    world.make_memories()
    world.say(dm, alice, "Good evening")
    assert world.last_answer().startswith("Following your preference for answers in French")


def test_a_member_who_leaves_no_longer_gets_the_groups_memories(world: World) -> None:
    tg = world.tg
    _, olga, bob = people(world)
    group = team(world, bot_status="administrator")
    world.say(group, olga, "@memo_bot the launch code name is Bluebird")
    world.make_memories()
    world.say(group, bob, "@memo_bot what is the code name")
    assert "Bluebird" in str(world.memory_given())

    world.deliver(tg.member_update(group, bob, "left"))
    assert world.rows("select role, active from memory_private.members where workspace_id = %s "
                      "and user_id = '202'", GROUP_WS) == [{"role": "member", "active": False}]
    # Still able to write (a discussion group lets non-members comment): no memories for him.
    world.say(group, bob, "@memo_bot what is the code name")
    assert world.memory_given() == {"mode": "none"}
    world.say(group, bob, "/memory")
    assert world.last_answer() == "I remember nothing in this chat yet."
    world.say(group, olga, "@memo_bot what is the code name")
    assert "Bluebird" in str(world.memory_given()), "the others still get them"


def test_members_roles_and_the_linked_state_follow_telegram(world: World) -> None:
    tg = world.tg
    alice, olga, bob = people(world)
    carol, dave = tg.user(203, "Carol"), tg.user(204, "Dave")
    group = world.tg.group(GROUP, "Team")
    tg.set_member(group, olga, "creator")
    tg.set_member(group, carol, "administrator")
    world.deliver(tg.bot_update(group, "administrator", by=olga))
    assert "chat_member" in (tg.allowed_updates or []), "the bot asks for member updates"

    def members() -> dict[str, tuple[str, bool]]:
        return {m["user_id"]: (m["role"], m["active"]) for m in world.rows(
            "select user_id, role, active from memory_private.members where workspace_id = %s",
            GROUP_WS)}

    def linked() -> bool:
        return bool(world.value("select linked from memory_private.chats "
                                "where workspace_id = %s", GROUP_WS))

    assert linked() and members() == {"201": ("owner", True), "203": ("admin", True)}
    world.deliver(tg.member_update(group, dave, "member"))
    world.deliver(tg.member_update(group, carol, "member"))
    world.deliver(tg.member_update(group, bob, "restricted", is_member=False))
    assert members() == {"201": ("owner", True), "203": ("member", True),
                         "204": ("member", True), "202": ("member", False)}
    tg.service(group, olga, left_chat_member=dave)
    world.deliver(tg.updates[-1])
    assert members()["204"] == ("member", False)
    world.deliver(tg.bot_update(group, "left", by=olga))
    assert not linked(), "a group the bot left is unlinked: its memories are not recalled"
    world.deliver(tg.bot_update(group, "member", by=olga))
    assert linked()
    tg.service(group, olga, migrate_to_chat_id=-1009999999999)
    world.deliver(tg.updates[-1])
    assert not linked(), "a group that became a supergroup (a new chat id) is unlinked"

    dm = tg.private(alice)
    world.say(dm, alice, "hello")
    world.deliver(tg.bot_update(dm, "kicked", by=alice))
    assert world.rows("select role, active from memory_private.members where workspace_id = %s",
                      PRIVATE_WS) == [{"role": "owner", "active": False}]
    assert world.rows("select identity from memory_private.bots where workspace_id = %s",
                      PRIVATE_WS) == [{"identity": f"tg:{tg.me['id']}"}]


def test_each_answer_is_one_request_running_then_succeeded_or_failed_with_its_spend(
        world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    world.chat.hold()
    msg = world.tg.message(dm, alice, "hello there")
    assert world.chat.waiting.wait(30)
    assert request_row(world, f"101:{msg['message_id']}")["status"] == "running"
    world.chat.release()
    world.deliver(world.tg.updates[-1])
    row = request_row(world, f"101:{msg['message_id']}")
    assert (row["status"], row["spent_usd"]) == ("succeeded", CALL_COST)

    chat: FakeChat = world.chat

    def tool_then_outage(body: JsonDict) -> JsonDict:
        chat.mode = "error"  # the next call fails: HTTP 500
        return {"tool": "query_memories", "arguments": {"query": "tea"}}

    chat.responder = tool_then_outage
    failed = world.say(dm, alice, "what do you know about tea?")
    row = request_row(world, f"101:{failed['message_id']}")
    assert (row["status"], row["spent_usd"]) == ("failed", CALL_COST), "the first call's spend"
    assert world.last_answer() == "Sorry, I could not answer this time."
    assert world.value("select count(*) from memory_private.messages where workspace_id = %s "
                       "and request_id = %s and role = 'assistant'", PRIVATE_WS,
                       f"101:{failed['message_id']}") == 0
    assert world.value("select sum(spent_usd) from memory_private.requests "
                       "where workspace_id = %s", PRIVATE_WS) == 2 * CALL_COST

    chat.mode, chat.responder = "ok", scripted_model
    world.tg.send_error = (403, "Forbidden: bot was blocked by the user")
    unsent = world.say(dm, alice, "are you there?")
    row = request_row(world, f"101:{unsent['message_id']}")
    assert (row["status"], row["spent_usd"]) == ("failed", CALL_COST), "answered, not delivered"
    assert world.value("select count(*) from memory_private.messages where workspace_id = %s "
                       "and request_id = %s and role = 'assistant'", PRIVATE_WS,
                       f"101:{unsent['message_id']}") == 0


def test_a_redelivered_update_is_answered_once(world: World) -> None:
    alice, _, _ = people(world)
    dm = world.tg.private(alice)
    msg = world.say(dm, alice, "hello once")
    world.deliver(world.tg._push({"message": msg}))  # Telegram delivers it again
    assert len(world.tg.sent) == 1 and len(world.chat.requests) == 1
    assert request_row(world, f"101:{msg['message_id']}")["status"] == "succeeded"
    assert Decimal(str(request_row(world, f"101:{msg['message_id']}")["spent_usd"])) == CALL_COST


def test_an_edit_that_no_longer_addresses_the_bot_takes_the_message_out_of_the_memory(
        world: World) -> None:
    _, _, bob = people(world)
    group = team(world)
    said = world.say(group, bob, "@memo_bot the budget is 40k")
    key = f"{GROUP}:{said['message_id']}"
    world.deliver(world.tg._push({"edited_message": {
        **said, "text": "the budget is 40k", "entities": [], "edit_date": said["date"] + 5}}))
    assert world.rows("select body, removal_reason from memory_private.messages "
                      "where workspace_id = %s and message_id = %s", GROUP_WS, key) == [
        {"body": None, "removal_reason": "removed"}]
    chatter = world.tg.message(group, bob, "lunch at noon?")
    world.deliver(world.tg.updates[-1])
    world.tg.edit(chatter, "@memo_bot lunch at noon?")
    world.deliver(world.tg.updates[-1])
    assert world.value("select count(*) from memory_private.messages where workspace_id = %s "
                       "and body like '%%lunch%%'", GROUP_WS) == 0, \
        "an edit never turns unanswered traffic into a conversation"


def test_webhook_mode_registers_its_secret_and_takes_only_telegrams_posts(
        conn: psycopg.Connection, db_dsn: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/tg/hook"
    with telegram_world(conn, db_dsn, mode="webhook", webhook_url=url, webhook_port=port,
                        webhook_secret="hook-secret_1") as world:
        tg = world.tg
        tg.wait(lambda: tg.webhook is not None, 30, "setWebhook")
        assert tg.webhook is not None
        assert (tg.webhook["url"], tg.webhook["secret_token"]) == (url, "hook-secret_1")
        assert {"message", "edited_message", "chat_member", "my_chat_member"} <= set(
            tg.webhook["allowed_updates"])
        alice, _, _ = people(world)
        tg.message(tg.private(alice), alice, "hello by webhook")
        update = tg.updates[-1]
        forged = httpx.post(url, json=update,
                            headers={"X-Telegram-Bot-Api-Secret-Token": "guess"})
        assert forged.status_code == 401
        posted = httpx.post(url, json=update,
                            headers={"X-Telegram-Bot-Api-Secret-Token": "hook-secret_1"})
        assert posted.status_code == 200
        world.deliver(update)
        assert [m["text"] for m in tg.sent] == ["You said: hello by webhook"]
        assert "getUpdates" not in tg.methods()


def test_start_and_help_answer_with_help_and_store_nothing(world: World) -> None:
    alice, _, bob = people(world)
    world.say(world.tg.private(alice), alice, "/start")
    assert world.last_answer().startswith("I answer with a long-term memory of this chat.")
    group = team(world)
    world.say(group, bob, "/help@memo_bot")
    assert len(world.tg.sent) == 2 and world.chat.requests == []
    assert world.value("select count(*) from memory_private.requests") == 0
