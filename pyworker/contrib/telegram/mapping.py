"""How Telegram maps onto the memory: workspaces, ids, topics, directed messages, roles, and the
citations shown to users. Pure functions of aiogram's types; docs/telegram.md says why each
choice was made.

- One workspace per group or supergroup (``<prefix>:group:<chat id>``): its creator is the
  owner, its administrators admins, everyone else a member, so the database's group rules (C6,
  C7) follow what the group's members see in Telegram. One workspace per user for their private
  chat with the bot (``<prefix>:user:<user id>``), with the user as its owner (C5).
- Ids are unique per workspace: a message is ``<chat id>:<message id>``, a request (one answer)
  is the id of the message it answers, a ``/memory`` request that id plus ``:memory``. A thread
  is the chat and topic the conversation happened in (``<chat id>/<topic>``).
- A topic is the forum topic (``message_thread_id`` of a topic message); the general topic, and
  every chat without topics, is topic 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from aiogram.enums import ChatMemberStatus, ChatType
from aiogram.types import Chat, ChatMemberUnion, Message, User

GROUP_TYPES = (ChatType.GROUP, ChatType.SUPERGROUP)
Role = Literal["owner", "admin", "member"]
TELEGRAM_LIMIT = 4096  # characters of one text message


@dataclass(frozen=True)
class Place:
    """Where a message lives in the memory."""

    workspace_id: str
    chat_id: str
    kind: Literal["private", "group"]
    topic_id: int

    @property
    def thread_id(self) -> str:
        return f"{self.chat_id}/{self.topic_id}"


def workspace_id(prefix: str, chat: Chat) -> str:
    if chat.type == ChatType.PRIVATE:
        return f"{prefix}:user:{chat.id}"
    return f"{prefix}:group:{chat.id}"


def topic_id(message: Message) -> int:
    """The forum topic of a message; 0 for the general topic and chats without topics (a
    ``message_thread_id`` outside a forum topic is a reply thread, not a topic)."""
    if message.is_topic_message and message.message_thread_id:
        return int(message.message_thread_id)
    return 0


def place_of(prefix: str, message: Message) -> Place:
    kind: Literal["private", "group"] = (
        "private" if message.chat.type == ChatType.PRIVATE else "group")
    return Place(workspace_id(prefix, message.chat), str(message.chat.id), kind,
                 topic_id(message))


def message_key(chat_id: int | str, message_id: int) -> str:
    return f"{chat_id}:{message_id}"


def request_key(message: Message) -> str:
    """The request that answers ``message`` (one request per answer)."""
    return message_key(message.chat.id, message.message_id)


def memory_request_key(message: Message) -> str:
    """The request of a ``/memory`` command: never the id of an answer, so an edit of the
    command never becomes a message of a conversation."""
    return f"{request_key(message)}:memory"


def text_of(message: Message) -> str | None:
    return message.text if message.text is not None else message.caption


# The fields of a forward before Bot API 7.0 (``forward_origin``). Telegram no longer sends them,
# but a local Bot API server of an older version, a bridge or a replayed update may: a message
# that carries any of them is a forward all the same (aiogram keeps them, deprecated, and keeps
# any field it no longer declares as an extra attribute).
LEGACY_FORWARD = ("forward_date", "forward_from", "forward_from_chat", "forward_sender_name")


def _field(value: object, name: str) -> Any:
    """A field of a Telegram object, typed (aiogram's model) or raw (an undeclared extra)."""
    if isinstance(value, dict):
        return value.get(name)
    return getattr(value, name, None)


def is_forwarded(message: Message) -> bool:
    """Whether the message is a forward: someone else's words, not its sender's
    (``forward_origin``, or the legacy fields of Bot API 6: ``forward_from``, ...)."""
    return message.forward_origin is not None or any(
        _field(message, name) is not None for name in LEGACY_FORWARD)


def _person(user: object) -> str:
    name = " ".join(str(part) for part in (_field(user, "first_name"),
                                           _field(user, "last_name")) if part)
    return f"{name or 'someone'} (user {_field(user, 'id')})"


def _chat(chat: object) -> str:
    return f"{_field(chat, 'title') or _field(chat, 'id')} (chat {_field(chat, 'id')})"


def origin_of(message: Message) -> str:
    """Who wrote a forwarded message, as Telegram tells it (``forward_origin``, else the
    legacy fields)."""
    origin: object = message.forward_origin
    if origin is None:  # a legacy forward: the same facts under the old names
        user, name = _field(message, "forward_from"), _field(message, "forward_sender_name")
        chat = _field(message, "forward_from_chat")
    else:
        user, name = _field(origin, "sender_user"), _field(origin, "sender_user_name")
        chat = _field(origin, "sender_chat") or _field(origin, "chat")
    if user is not None:
        return _person(user)
    if name:
        return str(name)
    if chat is not None:
        return _chat(chat)
    return "someone"


def reported_text(message: Message) -> str | None:
    """The text the memory stores for a message. A forward is reported as the quotation it
    is: a line naming its origin, then the text with every line quoted (``> ``). The database
    reads a quotation as no direct request (memory_private.request_form: "quoted"), so a
    forwarded "remember that ..." is refused as the forwarding member's request (C1, C2), and
    extraction sees whose words they were (V9)."""
    text = text_of(message)
    if text is None or not is_forwarded(message):
        return text
    quoted = "\n".join(f"> {line}" for line in text.split("\n"))
    return f"[forwarded from {origin_of(message)}]\n{quoted}"


def command_of(message: Message, me: User) -> str | None:
    """The bot command a message opens with (``/memory`` or ``/memory@this_bot``), lower-case,
    or None (also for a command addressed to another bot)."""
    text = text_of(message) or ""
    for entity in (message.entities or message.caption_entities or []):
        if entity.type == "bot_command" and entity.offset == 0:
            name, _, target = entity.extract_from(text)[1:].partition("@")
            if not target or target.lower() == (me.username or "").lower():
                return name.lower()
    return None


def is_directed(message: Message, me: User) -> bool:
    """Whether a message is meant for the bot: everything in a private chat; in a group a
    mention of the bot, a reply to one of its messages, or a command (for it), never a forward
    (its mentions are its author's). Nothing else in a group ever reaches the memory (V10)."""
    if message.chat.type == ChatType.PRIVATE:
        return True
    if is_forwarded(message):
        return False  # a mention in it is its author's, not the forwarding member's
    text = text_of(message) or ""
    username = (me.username or "").lower()
    for entity in (message.entities or message.caption_entities or []):
        if entity.type == "mention" and username \
                and entity.extract_from(text).lower() == f"@{username}":
            return True
        if entity.type == "text_mention" and entity.user is not None \
                and entity.user.id == me.id:
            return True
    if command_of(message, me) is not None:
        return True
    reply = replied_to(message)
    return reply is not None and reply.from_user is not None and reply.from_user.id == me.id


def replied_to(message: Message) -> Message | None:
    """The message this one really replies to. In a forum every message of a topic "replies"
    to the topic's creation message: that is no reply (not to the bot either, even when the bot
    created the topic)."""
    reply = message.reply_to_message
    if reply is None or reply.forum_topic_created is not None or (
            message.is_topic_message and reply.message_id == message.message_thread_id):
        return None
    return reply


def role_of(member: ChatMemberUnion) -> tuple[Role, bool]:
    """A Telegram chat member as a workspace member: (role, active)."""
    status = member.status
    if status == ChatMemberStatus.CREATOR:
        return "owner", True
    if status == ChatMemberStatus.ADMINISTRATOR:
        return "admin", True
    if status == ChatMemberStatus.MEMBER:
        return "member", True
    if status == ChatMemberStatus.RESTRICTED:
        return "member", bool(getattr(member, "is_member", False))
    return "member", False  # left, kicked


def bot_is_in(member: ChatMemberUnion) -> bool:
    """Whether the bot's own membership links the group (it can read and answer there)."""
    return role_of(member)[1]


# Citations -------------------------------------------------------------------------------------

CITATION = re.compile(r"([ \t]*)\[\s*source\s*:\s*([^\]]*)\]", re.IGNORECASE)


def source_label(message_id: str) -> str:
    """A cited message as the user can find it: a link for supergroup messages, otherwise its
    number in the chat."""
    chat, _, number = message_id.rpartition(":")
    if not number.isdigit():
        return message_id
    if chat.startswith("-100") and chat[4:].isdigit():
        return f"https://t.me/c/{chat[4:]}/{number}"
    return f"message {number}"


def render_citations(text: str, allowed: list[str]) -> str:
    """Replaces the model's ``[source: ID]`` markers by numbered references and lists them under
    the answer. Only ids in ``allowed`` (``memory.request_citations``) are shown; a marker that
    names anything else is dropped."""
    permitted = set(allowed)
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        refs = []
        for raw in match.group(2).split(","):
            key = raw.strip().strip("`'\"")
            if key in permitted:
                if key not in order:
                    order.append(key)
                refs.append(f"[{order.index(key) + 1}]")
        return match.group(1) + "".join(refs) if refs else ""

    body = CITATION.sub(number, text).strip()
    if not order:
        return body
    footer = "\n".join(f"[{i}] {source_label(key)}" for i, key in enumerate(order, 1))
    return f"{body}\n\nSources:\n{footer}"


def split_text(text: str, limit: int = TELEGRAM_LIMIT) -> list[str]:
    """Cuts a text into messages Telegram accepts, at line breaks where it can."""
    chunks: list[str] = []
    rest = text
    while len(rest) > limit:
        cut = rest.rfind("\n", 0, limit)
        if cut <= 0:
            cut = rest.rfind(" ", 0, limit)
        if cut <= 0:
            cut = limit
        chunks.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip("\n ")
    chunks.append(rest)
    return [c for c in chunks if c] or [text[:limit]]
