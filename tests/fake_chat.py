"""A fake OpenAI-compatible chat model with function calling, on 127.0.0.1, for the bot's tests.

    with FakeChat() as chat:          # chat.url == "http://127.0.0.1:PORT/v1"
        ...                            # PIMEM_TG_MODEL_URL=chat.url
        chat.requests[-1]              # every request body, in order

Its default responder, :func:`scripted_model`, behaves like a small, obedient model that reads the
bot's prompt: it asks ``manage_memory`` to remember, forget (after finding the memory with
``query_memories``) or turn memory on or off when the user's current message says so, passing
that message's id as ``sourceId``; it looks memories up and cites their sources (and one id it
was never shown, which the bot must not show); otherwise it answers, following a preference
("I prefer ...") that the memory beside the conversation holds. A test may set ``responder``
to its own function, ``mode = "error"`` for HTTP 500, or ``hold()`` to keep the next call
waiting until ``release()``.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.fake_server import JsonServer

JsonDict = dict[str, Any]
NEVER_SHOWN = "-100999:424242"  # a source id the model invents; never authorized


def say(text: str) -> JsonDict:
    return {"content": text}


def call(name: str, **arguments: Any) -> JsonDict:
    return {"tool": name, "arguments": arguments}


def conversation(body: JsonDict) -> tuple[str, JsonDict, str, list[JsonDict]]:
    """(the memory message, the current message's header, its text, the tool results so far)."""
    messages = body["messages"]
    memory = next((m["content"] for m in messages[1:] if m["role"] == "system"), "")
    user = next(m for m in messages if m["role"] == "user")
    head, _, text = user["content"].partition("\n")
    results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
    return memory, json.loads(head), text, results


def scripted_model(body: JsonDict) -> JsonDict:
    """The default behaviour (see the module docstring)."""
    memory, header, text, results = conversation(body)
    source = header["message_id"]
    lower = re.sub(r"^(@\w+[ ,]*)+", "", text.strip()).lower()
    toggles = {"turn memory off": "disable-memory", "turn memory on": "enable-memory"}
    for phrase, action in toggles.items():
        if phrase in lower:
            if not results:
                return call("manage_memory", action=action, sourceId=source)
            return say(results[-1].get("reason") or json.dumps(results[-1]))
    if lower.startswith("remember"):
        if not results:
            return call("manage_memory", action="remember", sourceId=source)
        return say(results[-1].get("reason") or json.dumps(results[-1]))
    forget = re.match(r"forget (?:what you know about |my |the )?(.+?)[.!]*$", lower)
    if forget:
        if not results:
            return call("query_memories", query=forget.group(1))
        if len(results) == 1:
            found = results[0].get("records") or []
            if not found:
                return say("I found nothing like that to forget.")
            return call("manage_memory", action="forget", sourceId=source,
                        memoryId=found[0]["id"])
        return say(results[-1].get("reason") or json.dumps(results[-1]))
    asked = re.match(r"what do you know about (.+?)[?.!]*$", lower)
    if asked:
        if not results:
            return call("query_memories", query=asked.group(1))
        records = results[0].get("records") or []
        if not records:
            return say("Nothing about that in my memory.")
        lines = [f"{r['title']} " + " ".join(f"[source: {s}]" for s in r["source_ids"])
                 for r in records]
        return say("\n".join(lines) + f" [source: {NEVER_SHOWN}]")
    preference = re.search(r"i prefer ([^.\"\\\]\n]+)", memory, re.IGNORECASE)
    if preference:
        return say(f"Following your preference for {preference.group(1).strip()}: "
                   f"noted, {text.strip()}")
    return say(f"You said: {text.strip()}")


class FakeChat(JsonServer):
    def __init__(self, *, prompt_tokens: int = 1000, completion_tokens: int = 50) -> None:
        self.responder: Callable[[JsonDict], JsonDict] = scripted_model
        self.mode = "ok"
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.requests: list[JsonDict] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._held = threading.Event()
        self.waiting = threading.Event()  # set while a held call waits
        self._released = threading.Event()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def handle(self, path: str, content_type: str, raw: bytes) -> tuple[int, Any]:
        return self._answer(json.loads(raw or b"{}"))

    def closing(self) -> None:
        self._released.set()

    def hold(self) -> None:
        """The next call waits until :meth:`release`."""
        self._released.clear()
        self._held.set()

    def release(self) -> None:
        self._released.set()

    def tool_calls(self) -> list[tuple[str, JsonDict, str]]:
        """Every tool call the model made: (name, arguments, id)."""
        found = []
        for body in self.requests:
            for m in body["messages"]:
                for c in m.get("tool_calls") or []:
                    found.append((c["function"]["name"], json.loads(c["function"]["arguments"]),
                                  c["id"]))
        unique = {c[2]: c for c in found}
        return list(unique.values())

    def _answer(self, body: JsonDict) -> tuple[int, JsonDict]:
        with self._lock:
            self.requests.append(body)
            held = self._held.is_set()
            self._held.clear()
        if held:
            self.waiting.set()
            self._released.wait(60)
            self.waiting.clear()
        if self.mode == "error":
            return 500, {"error": {"message": "fake provider error", "type": "server_error"}}
        reply = self.responder(body)
        message: JsonDict = {"role": "assistant", "content": reply.get("content")}
        finish = "stop"
        if "tool" in reply:
            message["tool_calls"] = [{
                "id": f"call_{next(self._ids)}", "type": "function",
                "function": {"name": reply["tool"],
                             "arguments": json.dumps(reply["arguments"])}}]
            finish = "tool_calls"
        usage = {"prompt_tokens": self.prompt_tokens,
                 "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        return 200, {"id": "fake-chat", "object": "chat.completion", "created": int(time.time()),
                     "model": body.get("model"), "usage": usage,
                     "choices": [{"index": 0, "finish_reason": finish, "message": message}]}
