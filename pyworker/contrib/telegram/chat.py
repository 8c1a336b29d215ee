"""The chat model: an OpenAI-compatible chat-completions endpoint with function calling (httpx).

The model gets the conversation, the request's recall answer beside it, and the two memory tools
as functions. Each tool call goes to the database through a handler the bot gives (which keeps
the model's tool call id); its result goes back to the model, up to ``max_tool_rounds`` rounds;
the last round offers no tool, so the model has to answer in words. Every call's usage is priced
from the configured table, and the sum is the answer's spend, also when the answer fails.

What the model sends back is hostile input: a malformed reply or tool call fails the answer
(with the spend so far); a tool call's arguments go to the database unchanged, which validates
them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import httpx

from pyworker.adapters.openai_compat import Price
from pyworker.payload import ModelRef

# (tool name, JSON arguments as the model wrote them, tool call id) -> the tool's result text
ToolHandler = Callable[[str, str, str], Awaitable[str]]


class ChatFailure(Exception):
    """No answer; ``cost_usd`` is what the calls made so far cost (the request's spend)."""

    def __init__(self, message: str, cost_usd: Decimal) -> None:
        super().__init__(message)
        self.message = message
        self.cost_usd = cost_usd


@dataclass
class ChatReply:
    text: str = ""
    calls: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    trace: list[str] = field(default_factory=list)  # tool names in call order


def function_tools(definitions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{name, description, parameters}`` definitions as chat-completions ``tools``."""
    return [{"type": "function", "function": d} for d in definitions]


class ChatModel:
    def __init__(self, *, base_url: str, api_key: str | None, model: ModelRef, price: Price,
                 max_tool_rounds: int = 4, timeout: float = 60.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.price = price
        self.max_tool_rounds = max_tool_rounds
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                       headers=headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _charge(self, reply: ChatReply, usage: Any) -> None:
        if not isinstance(usage, dict):
            raise ChatFailure("the provider reported no usage: the spend cannot be recorded",
                              reply.cost_usd)
        tin, tout = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(tin, int) or not isinstance(tout, int) or tin < 0 or tout < 0:
            raise ChatFailure(f"unreadable usage {usage!r}", reply.cost_usd)
        reply.calls += 1
        reply.input_tokens += tin
        reply.output_tokens += tout
        cost = (self.price.input * tin + self.price.output * tout) / Decimal(1_000_000)
        reply.cost_usd += cost.quantize(Decimal("0.00000001"))

    async def _complete(self, reply: ChatReply, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model.id, "messages": messages, "stream": False}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = "none" if final else "auto"
        try:
            response = await self._http.post(self.url, json=body)
        except httpx.HTTPError as exc:
            raise ChatFailure(f"the model call failed: {type(exc).__name__}: {exc}",
                              reply.cost_usd) from None
        if response.status_code >= 400:
            raise ChatFailure(f"the model answered HTTP {response.status_code}: "
                              f"{response.text[:300]}", reply.cost_usd)
        try:
            data = response.json()
            choice = data["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatFailure(f"unreadable model response: {exc!r}", reply.cost_usd) from None
        self._charge(reply, data.get("usage"))
        if not isinstance(message, dict):
            raise ChatFailure("unreadable model response: no message", reply.cost_usd)
        return message

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                    on_tool_call: ToolHandler) -> ChatReply:
        """The model's answer to ``messages``, its tool calls handled by ``on_tool_call``."""
        reply = ChatReply()
        history = list(messages)
        for round_no in range(self.max_tool_rounds + 1):
            final = round_no == self.max_tool_rounds
            message = await self._complete(reply, history, tools, final)
            calls = message.get("tool_calls") or []
            if not calls:
                text = message.get("content")
                if not isinstance(text, str) or not text.strip():
                    raise ChatFailure("the model gave no answer text", reply.cost_usd)
                reply.text = text.strip()
                return reply
            if final or not isinstance(calls, list):
                raise ChatFailure("the model still called tools when it had to answer",
                                  reply.cost_usd)
            history.append({"role": "assistant", "content": message.get("content"),
                            "tool_calls": calls})
            for call in calls:
                try:
                    call_id, function = call["id"], call["function"]
                    name, arguments = function["name"], function.get("arguments") or ""
                except (KeyError, TypeError):
                    raise ChatFailure(f"unreadable tool call {call!r:.200}",
                                      reply.cost_usd) from None
                if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                    raise ChatFailure(f"unreadable tool call {call!r:.200}", reply.cost_usd)
                reply.tool_calls += 1
                reply.trace.append(name)
                try:
                    content = await on_tool_call(name, arguments, call_id)
                except Exception as exc:  # the database is gone, the request unknown, ...
                    raise ChatFailure(f"the {name} call failed: {type(exc).__name__}: {exc}",
                                      reply.cost_usd) from exc
                history.append({"role": "tool", "tool_call_id": call_id, "content": content})
        raise ChatFailure("no answer after the tool rounds", reply.cost_usd)  # not reached
