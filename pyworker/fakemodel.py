"""A fake OpenAI-compatible chat-completions server on 127.0.0.1 for the worker tests.

    with FakeModel() as fake:            # fake.url == "http://127.0.0.1:PORT/v1"
        fake.mode = "ok"                 # or error | hang | malformed | oversize | length
        ...
        assert fake.calls == 1 and fake.violations == []

It answers streamed (SSE, with ``stream_options.include_usage``) and plain requests. By default
the reply is a valid extraction or consolidation built from the prompt's DATA block, so the real
Pi CLI and the ``openai`` adapter can run the whole pipeline against it. It counts calls, keeps
every request body, and records a violation (and answers 400) when a request offers ``tools``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
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


class FakeModel:
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
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # lifecycle -------------------------------------------------------------------------------

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

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


if __name__ == "__main__":  # a standalone fake for manual runs: python -m pyworker.fakemodel
    with FakeModel() as f:
        print(f.url, flush=True)
        threading.Event().wait()
