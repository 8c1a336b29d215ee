"""A fake Telegram Bot API server on 127.0.0.1 for the bot's tests (no network).

aiogram talks to it through its custom server setting (``TelegramAPIServer.from_base(fake.url)``,
``PIMEM_TG_API_BASE``), exactly as it talks to a local Bot API server. Tests script updates in and
read what the bot did:

    with FakeTelegram() as tg:
        alice = tg.user(101, "Alice")
        msg = tg.message(tg.private(alice), alice, "hello")      # queued for getUpdates
        ...
        assert tg.sent[-1]["text"] == "..."                       # what the bot sent

Like Telegram it numbers messages per chat, marks mentions and commands with entities (UTF-16
offsets), makes every message of a forum topic a reply to the topic's creation message, delivers
only the update kinds the bot asked for (``allowed_updates``), confirms updates by ``offset``,
and answers ``getChatMember`` / ``getChatAdministrators`` from a membership table that
``member_update`` and ``bot_update`` change. Every call is recorded; an unknown method is a
violation (answered 404).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qsl

from tests.fake_server import JsonServer

JsonDict = dict[str, Any]
JSON_PARAMS = {"allowed_updates", "reply_parameters", "reply_markup", "entities",
               "link_preview_options"}
ADMIN_RIGHTS = ("can_be_edited", "is_anonymous", "can_manage_chat", "can_delete_messages",
                "can_manage_video_chats", "can_restrict_members", "can_promote_members",
                "can_change_info", "can_invite_users", "can_post_stories", "can_edit_stories",
                "can_delete_stories", "can_send_welcome_messages", "can_post_messages",
                "can_edit_messages", "can_pin_messages", "can_manage_topics")
RESTRICTED_RIGHTS = ("can_send_messages", "can_send_audios", "can_send_documents",
                     "can_send_photos", "can_send_videos", "can_send_video_notes",
                     "can_send_voice_notes", "can_send_polls", "can_send_other_messages",
                     "can_add_web_page_previews", "can_react_to_messages", "can_edit_tag",
                     "can_change_info", "can_invite_users", "can_pin_messages",
                     "can_manage_topics")


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def entities_of(text: str) -> list[JsonDict]:
    """What Telegram marks in a text: @mentions and a leading /command (offsets in UTF-16)."""
    found = []
    command = re.match(r"/[A-Za-z0-9_]+(@[A-Za-z0-9_]+)?", text)
    if command:
        found.append({"type": "bot_command", "offset": 0, "length": utf16_len(command.group())})
    for m in re.finditer(r"(?<![\w@])@[A-Za-z0-9_]{5,32}", text):
        if command and m.start() < command.end():
            continue
        found.append({"type": "mention", "offset": utf16_len(text[:m.start()]),
                      "length": utf16_len(m.group())})
    return found


def member(status: str, user: JsonDict, **fields: Any) -> JsonDict:
    """A ChatMember object of the given status, with the fields the Bot API requires."""
    value: JsonDict = {"status": status, "user": user}
    if status == "creator":
        value["is_anonymous"] = False
    elif status == "administrator":
        value.update({right: right != "is_anonymous" and right != "can_be_edited"
                      for right in ADMIN_RIGHTS})
    elif status == "restricted":
        value.update(dict.fromkeys(RESTRICTED_RIGHTS, True))
        value.update(is_member=True, until_date=0)
    elif status == "kicked":
        value["until_date"] = 0
    value.update(fields)
    return value


class FakeTelegram(JsonServer):
    def __init__(self, *, bot_id: int = 7_000_001, username: str = "memo_bot",
                 first_name: str = "Memo") -> None:
        self.me: JsonDict = {"id": bot_id, "is_bot": True, "first_name": first_name,
                             "username": username, "can_join_groups": True,
                             "can_read_all_group_messages": False,
                             "supports_inline_queries": False}
        self.token = f"{bot_id}:FAKE_token_for_the_tests_0123456789"
        self.calls: list[tuple[str, JsonDict]] = []
        self.sent: list[JsonDict] = []  # the messages the bot sent, as returned to it
        self.violations: list[str] = []
        self.updates: list[JsonDict] = []
        self.confirmed = 0  # updates below this id were confirmed by getUpdates' offset
        self.allowed_updates: list[str] | None = None
        self.webhook: JsonDict | None = None
        self.members: dict[int, dict[int, JsonDict]] = {}
        self.chats: dict[int, JsonDict] = {}
        self.send_error: tuple[int, str] | None = None  # (code, description) for sendMessage
        self.on_send: Callable[[JsonDict], None] | None = None  # called with each message sent
        self._message_ids: dict[int, int] = {}
        self._topics: dict[tuple[int, int], JsonDict] = {}
        self._cond = threading.Condition()
        self._closing = False
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def handle(self, path: str, content_type: str, raw: bytes) -> tuple[int, Any]:
        match = re.fullmatch(r"/bot([^/]+)/([A-Za-z]+)", path)
        if match is None or match.group(1) != self.token:
            return 401, {"ok": False, "error_code": 401, "description": "Unauthorized"}
        return self._call(match.group(2), self._params(content_type, raw))

    def closing(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    # scripting: people, chats, messages, membership -----------------------------------------------

    @staticmethod
    def user(user_id: int, first_name: str, username: str | None = None) -> JsonDict:
        value: JsonDict = {"id": user_id, "is_bot": False, "first_name": first_name}
        if username:
            value["username"] = username
        return value

    def private(self, user: JsonDict) -> JsonDict:
        chat = {"id": user["id"], "type": "private", "first_name": user["first_name"]}
        self.chats[chat["id"]] = chat
        return chat

    def group(self, chat_id: int, title: str, *, forum: bool = False) -> JsonDict:
        chat: JsonDict = {"id": chat_id, "type": "supergroup", "title": title}
        if forum:
            chat["is_forum"] = True
        self.chats[chat_id] = chat
        self.members.setdefault(chat_id, {})
        return chat

    def set_member(self, chat: JsonDict, user: JsonDict, status: str, **fields: Any) -> None:
        """Sets a membership without an update (what Telegram knew before the bot joined)."""
        with self._cond:
            self.members.setdefault(chat["id"], {})[user["id"]] = member(status, user, **fields)

    def member_update(self, chat: JsonDict, user: JsonDict, status: str,
                      **fields: Any) -> JsonDict:
        """A ``chat_member`` update: ``user`` now has ``status`` in ``chat``."""
        return self._membership("chat_member", chat, user, status, fields)

    def bot_update(self, chat: JsonDict, status: str, *, by: JsonDict | None = None,
                   **fields: Any) -> JsonDict:
        """A ``my_chat_member`` update: the bot was added (member, administrator) or removed
        (left, kicked); in a private chat the user blocked (kicked) or restarted it."""
        return self._membership("my_chat_member", chat, self.me, status, fields, by=by)

    def _membership(self, kind: str, chat: JsonDict, user: JsonDict, status: str,
                    fields: JsonDict, by: JsonDict | None = None) -> JsonDict:
        with self._cond:
            table = self.members.setdefault(chat["id"], {})
            old = table.get(user["id"]) or member("left", user)
            new = member(status, user, **fields)
            table[user["id"]] = new
        return self._push({kind: {"chat": chat, "from": by or user, "date": int(time.time()),
                                  "old_chat_member": old, "new_chat_member": new}})

    def create_topic(self, chat: JsonDict, creator: JsonDict, name: str) -> int:
        """A forum topic; its id is the id of its creation message, as in Telegram."""
        created = self._new_message(chat, creator, None)
        created.update(message_thread_id=created["message_id"], is_topic_message=True,
                       forum_topic_created={"name": name, "icon_color": 7322096})
        self._topics[(chat["id"], created["message_id"])] = created
        self._push({"message": created})
        return int(created["message_id"])

    def message(self, chat: JsonDict, sender: JsonDict, text: str, *, topic: int | None = None,
                reply_to: JsonDict | None = None, forwarded_from: JsonDict | None = None,
                legacy_forward: bool = False) -> JsonDict:
        """A text message from ``sender``; in a forum ``topic``, as a reply to ``reply_to``;
        a forward of ``forwarded_from``'s words (a user: ``forward_origin`` of type user, or
        with ``legacy_forward`` only the fields of Bot API 6, ``forward_from`` and
        ``forward_date``)."""
        msg = self._new_message(chat, sender, text)
        if forwarded_from is not None and legacy_forward:
            msg.update(forward_from=forwarded_from, forward_date=msg["date"] - 60)
        elif forwarded_from is not None:
            msg["forward_origin"] = {"type": "user", "date": msg["date"] - 60,
                                     "sender_user": forwarded_from}
        if topic:
            msg.update(message_thread_id=topic, is_topic_message=True)
            reply_to = reply_to or self._topics[(chat["id"], topic)]
        if reply_to is not None:
            msg["reply_to_message"] = {k: v for k, v in reply_to.items()
                                       if k != "reply_to_message"}
        self._push({"message": msg})
        return msg

    def service(self, chat: JsonDict, sender: JsonDict, **fields: Any) -> JsonDict:
        """A service message (new_chat_members, left_chat_member, migrate_to_chat_id, ...)."""
        msg = self._new_message(chat, sender, None)
        msg.update(fields)
        self._push({"message": msg})
        return msg

    def edit(self, msg: JsonDict, text: str) -> JsonDict:
        """An ``edited_message`` update: the same message with a new text."""
        edited = {**msg, "text": text, "edit_date": int(time.time())}
        edited.pop("entities", None)
        if entities_of(text):
            edited["entities"] = entities_of(text)
        self._push({"edited_message": edited})
        return edited

    def _new_message(self, chat: JsonDict, sender: JsonDict, text: str | None) -> JsonDict:
        with self._cond:
            number = self._message_ids.get(chat["id"], 0) + 1
            self._message_ids[chat["id"]] = number
        msg: JsonDict = {"message_id": number, "date": int(time.time()), "chat": chat,
                         "from": sender}
        if text is not None:
            msg["text"] = text
            if entities_of(text):
                msg["entities"] = entities_of(text)
        return msg

    def _push(self, payload: JsonDict) -> JsonDict:
        with self._cond:
            update = {"update_id": len(self.updates) + 1, **payload}
            self.updates.append(update)
            self._cond.notify_all()
        return update

    # reading what the bot did ---------------------------------------------------------------------

    def methods(self) -> list[str]:
        return [name for name, _ in self.calls]

    def wait_sent(self, count: int, timeout: float = 30.0) -> list[JsonDict]:
        """Waits until the bot sent at least ``count`` messages; returns them all."""
        self.wait(lambda: len(self.sent) >= count, timeout, f"{count} sent messages")
        return list(self.sent)

    def wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; calls: "
                                         f"{self.methods()[-20:]}")
                self._cond.wait(left)

    # the API --------------------------------------------------------------------------------------

    @staticmethod
    def _params(content_type: str, raw: bytes) -> JsonDict:
        if content_type.startswith("application/json"):
            return dict(json.loads(raw or b"{}"))
        if content_type.startswith("multipart/form-data"):
            parsed = BytesParser(policy=HTTP).parsebytes(
                f"Content-Type: {content_type}\r\n\r\n".encode() + raw)
            pairs = [(part.get_param("name", header="content-disposition"),
                      part.get_content()) for part in parsed.iter_parts()]
        else:
            pairs = parse_qsl(raw.decode(), keep_blank_values=True)
        params: JsonDict = {}
        for key, value in pairs:
            params[str(key)] = json.loads(value) if key in JSON_PARAMS else value
        return params

    def _call(self, method: str, params: JsonDict) -> tuple[int, JsonDict]:
        name = method.lower()
        with self._cond:
            self.calls.append((method, params))
            self._cond.notify_all()
        handler = getattr(self, f"_api_{name}", None)
        if handler is None:
            self.violations.append(f"unknown method {method}")
            return 404, {"ok": False, "error_code": 404, "description": "Not Found"}
        result = handler(params)
        if isinstance(result, tuple):
            code, description = result
            return code, {"ok": False, "error_code": code, "description": description}
        return 200, {"ok": True, "result": result}

    def _api_getme(self, params: JsonDict) -> Any:
        return self.me

    def _api_deletewebhook(self, params: JsonDict) -> Any:
        self.webhook = None
        return True

    def _api_setwebhook(self, params: JsonDict) -> Any:
        self.webhook = params
        if params.get("allowed_updates") is not None:
            self.allowed_updates = list(params["allowed_updates"])
        return True

    def _api_sendchataction(self, params: JsonDict) -> Any:
        return True

    def _api_getupdates(self, params: JsonDict) -> Any:
        if self.webhook is not None:
            return 409, "Conflict: can't use getUpdates method while webhook is active"
        offset = int(params.get("offset") or 0)
        wait = min(float(params.get("timeout") or 0), 30.0)
        if params.get("allowed_updates") is not None:
            self.allowed_updates = list(params["allowed_updates"])
        deadline = time.monotonic() + wait
        with self._cond:
            self.confirmed = max(self.confirmed, offset)
            self._cond.notify_all()
            while True:  # a confirmed update is never delivered again
                due = [u for u in self.updates
                       if u["update_id"] >= max(offset, self.confirmed, 1) and self._allowed(u)]
                left = deadline - time.monotonic()
                if due or left <= 0 or self._closing:
                    return due[:100]
                self._cond.wait(left)

    def _allowed(self, update: JsonDict) -> bool:
        kind = next(k for k in update if k != "update_id")
        if self.allowed_updates:
            return kind in self.allowed_updates
        return kind not in ("chat_member", "message_reaction", "message_reaction_count")

    def _api_sendmessage(self, params: JsonDict) -> Any:
        if self.send_error is not None:
            return self.send_error
        chat_id = int(params["chat_id"])
        chat = self.chats.get(chat_id) or {"id": chat_id, "type": "private", "first_name": "?"}
        msg = self._new_message(chat, self.me, str(params["text"]))
        thread = params.get("message_thread_id")
        if thread:
            msg.update(message_thread_id=int(thread), is_topic_message=True)
        reply = params.get("reply_parameters")
        if reply:
            msg["reply_to_message"] = {"message_id": int(reply["message_id"]),
                                       "date": msg["date"], "chat": chat}
        with self._cond:
            self.sent.append(msg)
            self._cond.notify_all()
        if self.on_send is not None:
            self.on_send(msg)
        return msg

    def _api_getchatmember(self, params: JsonDict) -> Any:
        chat_id, user_id = int(params["chat_id"]), int(params["user_id"])
        with self._cond:
            found = self.members.get(chat_id, {}).get(user_id)
        return found or member("left", self.user(user_id, "Someone"))

    def _api_getchatadministrators(self, params: JsonDict) -> Any:
        with self._cond:
            table = dict(self.members.get(int(params["chat_id"]), {}))
        return [m for m in table.values() if m["status"] in ("creator", "administrator")]
