"""The declared test double: a fake OpenAI-compatible chat-completions server on 127.0.0.1.

The tests and the bench (:mod:`pyworker.lab.bench.worker`) share it; no runtime module imports
it (``tests/test_layout.py`` checks that).

    with FakeModel() as fake:            # fake.url == "http://127.0.0.1:PORT/v1"
        fake.mode = "ok"                 # or error | hang | malformed | oversize | length
        ...
        assert fake.calls == 1 and fake.violations == []

    fake.mode = "hostile"                # each call answers the next of HOSTILE in turn
    fake.mode = "hostile:nul_title"      # or always that one

It answers streamed (SSE, with ``stream_options.include_usage``) and plain requests. By default
the reply is a valid extraction or consolidation built from the prompt's DATA block, so the real
Pi CLI and the ``openai`` adapter can run the whole pipeline against it. It counts calls, keeps
every request body, and records a violation (and answers 400) when a request offers ``tools``.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

DATA_BLOCK = re.compile(r"<<<DATA\n(.*)\nDATA>>>", re.DOTALL)


def prompt_text(body: dict[str, Any]) -> str:
    """The text of the last user message of a chat-completions request."""
    for msg in reversed(body.get("messages", [])):
        if msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def default_reply(body: dict[str, Any]) -> str:
    """A valid output for the task in the prompt: every source, or the newest 12 candidates."""
    text = prompt_text(body)
    match = DATA_BLOCK.search(text)
    data = json.loads(match.group(1)) if match else {}
    if "TASK: consolidate" in text:
        cands = sorted(data.get("candidates", []), key=lambda c: c["id"], reverse=True)[:12]
        index = "\n".join(f"[#{c['id']}] {c['title'][:80]}" for c in cands)
        return json.dumps({"index": index, "record_ids": [c["id"] for c in cands]})
    sources = data.get("sources", [])
    if not sources:
        return json.dumps({"title": "", "summary": "", "source_ids": []})
    first = next((s for s in sources if s["role"] == "user"), sources[0])
    summary = "\n".join(f"- {s['speaker_id']}: {s['text'][:200]} [{s['id']}]" for s in sources)
    return json.dumps({"title": f"Fake memory: {first['text'][:60]}",
                       "summary": summary[:3500], "source_ids": [s["id"] for s in sources]},
                      ensure_ascii=False)


def oversize_reply(body: dict[str, Any]) -> str:
    valid = json.loads(default_reply(body))
    if "index" in valid:
        valid["index"] = "x" * 4600
    else:
        valid["title"] = valid["title"] or "t"
        valid["summary"] = "é" * 2100  # 4,200 bytes, 2,100 characters: bytes count, not chars
    return json.dumps(valid)


class LocalServer:
    """A threaded HTTP server on 127.0.0.1 (an ephemeral port) serving from a daemon thread: the
    lifecycle every fake server shares (this model server, the tests' fake Bot API). A subclass
    passes its handler class and may override :meth:`closing`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        # Checks for shutdown every 50 ms (the default 0.5 s is what each stop would wait).
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True)

    def closing(self) -> None:
        """Called before the server shuts down: release what waits."""

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.closing()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeModel(LocalServer):
    def __init__(self, *, prompt_tokens: int = 1200, completion_tokens: int = 300) -> None:
        self.mode = "ok"
        self.responder: Callable[[dict[str, Any]], str] = default_reply
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.calls = 0
        self.requests: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.call_started = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.hostile_cycle: list[str] = list(HOSTILE)  # what mode "hostile" serves, in turn
        self.hostile_served: collections.Counter[str] = collections.Counter()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            # Answers go out in several writes; without TCP_NODELAY a client that keeps its
            # connection open waits ~40 ms per call for the delayed ACK (measured by the bench).
            disable_nagle_algorithm = True
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                try:
                    fake._handle(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away mid-answer (a killed worker): nothing to send

            def do_GET(self) -> None:
                self._json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

            def _json(self, status: int, value: Any) -> None:
                raw = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self._handler = Handler
        super().__init__(Handler)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def closing(self) -> None:
        self.release.set()  # a held call answers, so that the server can stop

    def reset(self, mode: str = "ok") -> None:
        with self._lock:
            self.mode = mode
            self.calls = 0
            self.requests.clear()
            self.violations.clear()
            self.call_started.clear()
            self.release.clear()

    # handling --------------------------------------------------------------------------------

    def _handle(self, h: Any, body: dict[str, Any]) -> None:
        with self._lock:
            self.calls += 1
            self.requests.append(body)
            mode = self.mode
        if "tools" in body or "functions" in body or "tool_choice" in body:
            self.violations.append(f"request offered tools: {sorted(body)}")
            h._json(400, {"error": {"message": "tools are not allowed", "type": "fake"}})
            return
        self.call_started.set()
        if mode.startswith("hostile"):
            self._hostile(h, body, mode)
            return
        if mode == "error":
            h._json(500, {"error": {"message": "fake provider error", "type": "server_error"}})
            return
        if mode == "hang":
            while not self.release.wait(0.1):
                pass
            try:
                h._json(503, {"error": {"message": "released", "type": "fake"}})
            except OSError:
                pass
            return
        if mode == "malformed":
            content = "Sure! Here is the memory: {title: oops"
        elif mode == "oversize":
            content = oversize_reply(body)
        else:
            content = self.responder(body)
        finish = "length" if mode == "length" else "stop"
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        model = body.get("model", "m")
        if not body.get("stream"):
            h._json(200, {"id": "fake-1", "object": "chat.completion", "created": int(time.time()),
                          "model": model, "usage": usage,
                          "choices": [{"index": 0, "finish_reason": finish,
                                       "message": {"role": "assistant", "content": content}}]})
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()

        def event(value: dict[str, Any]) -> None:
            h.wfile.write(b"data: " + json.dumps(value).encode() + b"\n\n")
            h.wfile.flush()

        base = {"id": "fake-1", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]})
        for i in range(0, len(content), 200):
            event({**base, "choices": [{"index": 0, "delta": {"content": content[i:i + 200]},
                                        "finish_reason": None}]})
        event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            event({**base, "choices": [], "usage": usage})
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()
        h.close_connection = True


    def _hostile(self, h: Any, body: dict[str, Any], mode: str) -> None:
        """Answers as a hostile provider (HOSTILE): the named mode, or the next in turn."""
        with self._lock:
            if mode == "hostile":
                name = self.hostile_cycle[sum(self.hostile_served.values())
                                          % len(self.hostile_cycle)]
            else:
                name = mode.split(":", 1)[1]
            self.hostile_served[name] += 1
        reply = HOSTILE[name](body)
        usage = reply.usage
        if usage is None:
            usage = json.dumps({"prompt_tokens": self.prompt_tokens,
                                "completion_tokens": self.completion_tokens,
                                "total_tokens": self.prompt_tokens + self.completion_tokens})
        content = default_reply(body) if reply.content is None else reply.content
        message = reply.message or json.dumps({"role": "assistant", "content": content})
        model = json.dumps(body.get("model", "m"))
        created = int(time.time())
        if not body.get("stream"):
            raw = reply.body if reply.body is not None else (
                f'{{"id": "fake-h", "object": "chat.completion", "created": {created}, '
                f'"model": {model}, ' + (f'"usage": {usage}, ' if usage else "")
                + f'"choices": [{{"index": 0, "finish_reason": "{reply.finish}", '
                f'"message": {message}}}]}}').encode()
            h.send_response(reply.status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(raw) + (1000 if reply.truncate else 0)))
            h.end_headers()
            h.wfile.write(raw)
            h.wfile.flush()
            if reply.truncate:
                h.close_connection = True
            return
        h.send_response(reply.status)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        if reply.body is not None:  # the stream itself is broken
            h.wfile.write(b"data: " + reply.body + b"\n\n")
            h.wfile.flush()
            return
        head = (f'{{"id": "fake-h", "object": "chat.completion.chunk", "created": {created}, '
                f'"model": {model}, ')

        def event(rest: str) -> None:
            h.wfile.write(("data: " + head + rest + "}\n\n").encode())
            h.wfile.flush()

        event('"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, '
              '"finish_reason": null}]')
        if reply.message is not None:
            event(f'"choices": [{{"index": 0, "delta": {reply.message}, '
                  '"finish_reason": null}]')
        else:
            for i in range(0, len(content), 2000):
                event('"choices": [{"index": 0, "delta": {"content": '
                      + json.dumps(content[i:i + 2000]) + '}, "finish_reason": null}]')
                if reply.truncate:
                    return  # the connection drops mid-stream
        event(f'"choices": [{{"index": 0, "delta": {{}}, "finish_reason": "{reply.finish}"}}]')
        if usage and (body.get("stream_options") or {}).get("include_usage"):
            event(f'"choices": [], "usage": {usage}')
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()


# Hostile replies -----------------------------------------------------------------------------
# What a provider, or a model steered by what it read, may send back. Each entry answers one
# request: the model's text (content), the usage object as raw JSON text (so it can hold NaN or
# a 5,000-digit number), the finish reason, the HTTP status, or a whole body that is not a valid
# response. The worker must survive every one: close the attempt with what can be known of its
# usage, charge at most the reserve, and go on.


@dataclass(frozen=True)
class Hostile:
    content: str | None = None  # the model's text; None: the valid reply for the prompt
    usage: str | None = None  # the usage object as raw JSON; None: the normal one; "": none
    finish: str = "stop"
    status: int = 200
    body: bytes | None = None  # the whole body (or SSE data) instead of a response
    message: str | None = None  # the choice's message as raw JSON instead of text content
    truncate: bool = False  # the connection drops before the body is complete


def _valid(body: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(default_reply(body))
    return value


def _with(body: dict[str, Any], **fields: Any) -> str:
    return json.dumps({**_valid(body), **fields})


def _ids_key(body: dict[str, Any]) -> str:
    return "record_ids" if "record_ids" in _valid(body) else "source_ids"


def _text_key(body: dict[str, Any]) -> str:
    return "index" if "index" in _valid(body) else "title"


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_DIGITS = "9" * 5000

HOSTILE: dict[str, Callable[[dict[str, Any]], Hostile]] = {
    # the model's text
    "deep_nesting": lambda b: Hostile(content=DEEP),
    "huge_integer": lambda b: Hostile(
        content=_with(b).replace(f'"{_ids_key(b)}": [', f'"{_ids_key(b)}": [{HUGE_DIGITS}, ')),
    "big_id": lambda b: Hostile(content=_with(b, **{_ids_key(b): [10**30]})),
    "nul_title": lambda b: Hostile(content=_with(b, **{_text_key(b): "Tea\u0000time"})),
    "lone_surrogate": lambda b: Hostile(
        content=_with(b, **{_text_key(b): "X"}).replace('"X"', '"\\ud800 broken"')),
    "float_ids": lambda b: Hostile(content=_with(b).replace(f'"{_ids_key(b)}": [',
                                                            f'"{_ids_key(b)}": [1.5, ')),
    "wrong_types": lambda b: Hostile(content=json.dumps(
        {k: (5 if isinstance(v, str) else "r1-u") for k, v in _valid(b).items()})),
    "token_ids": lambda b: Hostile(content=_with(b, **{_ids_key(b): [
        "sk-live-0123456789abcdefghijKLMN", "\u001b[31mred\u001b[0m", "ghp_" + "a" * 36]})),
    "escape_sequences": lambda b: Hostile(content=_with(b, **{
        _text_key(b): "\u001b[2J\u001b]0;pwned\u0007\u202eevil\u202c title"})),
    "oversize": lambda b: Hostile(content=oversize_reply(b)),
    "huge_content": lambda b: Hostile(content="x" * 3_000_000),
    "not_object": lambda b: Hostile(content="[1, 2, 3]"),
    "nan_literal": lambda b: Hostile(
        content=_with(b, **{_text_key(b): "X"}).replace('"X"', "NaN")),
    "infinity_id": lambda b: Hostile(content=_with(b).replace(f'"{_ids_key(b)}": [',
                                                              f'"{_ids_key(b)}": [1e999, ')),
    "empty": lambda b: Hostile(content=""),
    "extra_key_escape": lambda b: Hostile(content=_with(b, **{"\u001b]0;pwned\u0007": 1})),
    "double_encoded": lambda b: Hostile(content=json.dumps(default_reply(b))),
    # usage that is not numbers the database could store
    "usage_negative": lambda b: Hostile(usage='{"prompt_tokens": -5, "completion_tokens": -1}'),
    "usage_nan": lambda b: Hostile(usage='{"prompt_tokens": NaN, "completion_tokens": 300}'),
    "usage_huge": lambda b: Hostile(
        usage=f'{{"prompt_tokens": {HUGE_DIGITS}, "completion_tokens": 300}}'),
    "usage_float": lambda b: Hostile(usage='{"prompt_tokens": 1200.5, "completion_tokens": 3}'),
    "usage_string": lambda b: Hostile(usage='{"prompt_tokens": "1200", "completion_tokens": 3}'),
    "usage_overflow": lambda b: Hostile(
        usage='{"prompt_tokens": 1099511627776, "completion_tokens": 3}'),
    "usage_missing": lambda b: Hostile(usage=""),
    # a valid reply whose usage is worth far more than the reserve: charged the reserve
    "usage_over_reserve": lambda b: Hostile(
        usage='{"prompt_tokens": 2000000000, "completion_tokens": 300}'),
    # the response itself
    "body_not_json": lambda b: Hostile(body=b"<html><body>\x1b[31mBad gateway</body></html>"),
    "body_deep": lambda b: Hostile(body=DEEP.encode()),
    "body_no_choices": lambda b: Hostile(
        body=b'{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 0}}'),
    "body_choices_not_list": lambda b: Hostile(body=b'{"choices": "no", "usage": 7}'),
    "body_content_object": lambda b: Hostile(
        message='{"role": "assistant", "content": {"title": "not text"}}'),
    "tool_calls_only": lambda b: Hostile(message=(
        '{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": '
        '"function", "function": {"name": "manage_memory", "arguments": "{}"}}]}')),
    "huge_int_elsewhere": lambda b: Hostile(usage=(
        '{"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": '
        + HUGE_DIGITS + "}")),
    "status_500_html": lambda b: Hostile(status=500, body=b"<html>\x1b[5mdown</html>"),
    "status_429": lambda b: Hostile(
        status=429, body=b'{"error": {"message": "slow down \\u001b[31m", "type": "rate"}}'),
    "finish_length": lambda b: Hostile(finish="length"),
    "truncated": lambda b: Hostile(truncate=True),
}


if __name__ == "__main__":  # a standalone fake for manual runs: python -m pyworker.testing
    with FakeModel() as f:
        print(f.url, flush=True)
        threading.Event().wait()
