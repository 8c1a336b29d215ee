"""The worker's own cost: overhead per model call (Pi RPC vs a direct HTTP call) and peak RSS.

Both adapters call the same local fake OpenAI-compatible server (``pyworker/testing.py``), which
answers at once, so what is measured is the adapters' overhead, not a model. The fake runs in
its own process so that it does not share the measuring process's interpreter lock.

- overhead: interleaved calls of a bare HTTP POST (httpx, the floor), the ``openai`` adapter
  (the direct HTTP call) and the ``pi`` adapter (one long-lived ``pi --mode rpc`` process);
  the Pi process start is reported apart, since it happens once per worker, not per call.
- memory: a worker process runs real jobs (or, while the job machinery is missing, adapter
  calls only) and reports its own peak RSS and, for Pi, the Node process's peak RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

from pyworker.lab.bench.db import not_available, summarize

PRICES: dict[str, Any] = {"input": 3, "output": 15, "cacheRead": 0.3, "cacheWrite": 3.75}

FAKE_SERVER = """
import sys
from pyworker.testing import FakeModel
with FakeModel() as fake:
    print(fake.url, flush=True)
    sys.stdin.read()
"""


@contextmanager
def fake_server() -> Iterator[str]:
    """The fake model server in a child process; yields its base URL."""
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError("the fake model server did not start (pyworker/testing.py)")
        yield url
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fake_models(url: str) -> dict[str, Any]:
    return {"providers": {"fake": {
        "baseUrl": url, "api": "openai-completions", "apiKey": "$FAKE_API_KEY",
        "models": [{"id": "m", "contextWindow": 32000, "maxTokens": 2048, "cost": PRICES}]}}}


def sample_prompt() -> Any:
    """A realistic extraction prompt: three conversation turns, as a claim would carry."""
    from pyworker.payload import ClaimPayload
    from pyworker.prompting import build_prompt

    sources = []
    for k in range(3):
        sources.append({"id": f"m{2 * k}", "role": "user", "speaker_id": "alice",
                        "thread_id": "t1", "created_at": f"2026-01-01T10:0{k}:00Z",
                        "text": "Please draft the release notes for version 2.1. I prefer bullet "
                                "points, and remember that the changelog is still missing."})
        sources.append({"id": f"m{2 * k + 1}", "role": "assistant", "speaker_id": "bot1",
                        "thread_id": "t1", "created_at": f"2026-01-01T10:0{k}:05Z",
                        "text": "Here is a first draft with bullet points. The changelog section "
                                "is marked as open until you send it."})
    payload = ClaimPayload.model_validate({
        "job_id": 1, "workspace_id": "ws1", "token": "00000000-0000-0000-0000-000000000001",
        "phase": "extract", "attempt": 1, "lease_expires_at": "2026-01-01T10:02:00Z",
        "scope": {"scope_id": 1, "kind": "private", "bot_id": "bot1", "chat_id": "dm-alice",
                  "user_id": "alice", "topic_id": None},
        "origin_request_id": "r1", "model": {"provider": "fake", "id": "m"},
        "budget": {"request_left_usd": 0.5, "workspace_left_usd": 10},
        "limits": {"summary_bytes": 4000, "title_bytes": 300, "index_bytes": 4500,
                   "index_ids": 12, "batch_bytes": 24000, "candidates": 48},
        "input": {"sources": sources, "existing": []}, "checkpoint": None})
    return payload.model, build_prompt(payload)


def measure_overhead(url: str, calls: int) -> dict[str, Any]:
    import httpx

    from pyworker.adapters.openai_compat import OpenAIAdapter, Price
    from pyworker.adapters.pi import PiAdapter, pi_unavailable_reason

    model, prompt = sample_prompt()
    cancel = threading.Event()
    direct = OpenAIAdapter(base_url=url, api_key="fake-key",
                           prices={"fake/m": Price(input=Decimal(PRICES["input"]),
                                                   output=Decimal(PRICES["output"]))})
    body = {"model": "m", "messages": [{"role": "system", "content": prompt.system},
                                       {"role": "user", "content": prompt.user}]}
    client = httpx.Client(timeout=30)

    def raw() -> None:
        # A connection per call: on a kept-alive connection the fake server's two writes
        # (headers, then body) meet the client's delayed ACK and every call waits ~40 ms.
        r = client.post(f"{url}/chat/completions", json=body,
                        headers={"Authorization": "Bearer fake-key", "Connection": "close"})
        r.raise_for_status()

    def via(adapter: Any) -> None:
        adapter.complete(model, prompt, deadline=time.monotonic() + 30, cancel=cancel)

    notes: list[str] = []
    reason = pi_unavailable_reason()
    pi: PiAdapter | None = None
    pi_start_ms = None
    if reason is None:
        pi = PiAdapter(models=fake_models(url), env={"FAKE_API_KEY": "fake-key"})
        t0 = time.perf_counter()
        try:
            via(pi)  # the first call starts the Pi process
        except Exception as exc:  # noqa: BLE001 - reported, and the other adapters still run
            reason = f"the first Pi call failed: {exc}"
            pi.close()
            pi = None
        pi_start_ms = round((time.perf_counter() - t0) * 1000, 1)
    samples: dict[str, list[int]] = {"http (httpx POST)": [], "openai adapter (direct HTTP)": []}
    if pi is not None:
        samples["pi adapter (RPC)"] = []
    try:
        for _ in range(3):  # warm-up
            raw()
            via(direct)
            if pi is not None:
                via(pi)
        for _ in range(calls):
            for name, fn in (("http (httpx POST)", raw),
                             ("openai adapter (direct HTTP)", lambda: via(direct)),
                             ("pi adapter (RPC)", (lambda: via(pi)) if pi else None)):
                if fn is None:
                    continue
                t0 = time.perf_counter_ns()
                fn()
                samples[name].append(time.perf_counter_ns() - t0)
    finally:
        client.close()
        direct.close()
        if pi is not None:
            pi.close()
    adapters = {name: summarize(s) for name, s in samples.items()}
    added = None
    if pi is not None:
        added = round(adapters["pi adapter (RPC)"]["p50_ms"]
                      - adapters["http (httpx POST)"]["p50_ms"], 2)
        notes.append("Pi's added cost is its p50 minus the bare HTTP call's p50 (httpx, one "
                     "connection per call, the same prompt, the same fake server; Pi streams "
                     "its answer).")
        notes.append(f"The Pi process starts once per worker (first call {pi_start_ms} ms); "
                     "every later call reuses it.")
    else:
        adapters["pi adapter (RPC)"] = not_available(f"Pi: {reason}")
        notes.append(f"Pi is not available here: {reason}.")
    return {"status": "ok", "calls": calls, "adapters": adapters, "pi_added_ms": added,
            "pi_start_ms": pi_start_ms, "notes": notes}


# Peak RSS, in a process of its own ---------------------------------------------------------------

def _vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_child(adapter_name: str, url: str, dsn: str | None, calls: int) -> dict[str, Any]:
    """Runs in the child: a worker with the given adapter works through the prepared jobs
    (``dsn`` given) or makes ``calls`` adapter calls; returns its peak RSS (and Pi's)."""
    from pyworker.adapters import make_adapter
    from pyworker.adapters.pi import PiAdapter

    if adapter_name == "pi":
        adapter: Any = PiAdapter(models=fake_models(url), env={"FAKE_API_KEY": "fake-key"})
    else:
        adapter = make_adapter(adapter_name)
    done = 0
    pi_mib = None
    try:
        if dsn is not None:
            from pyworker.lab.bench.jobs import NoMaintenanceDatabase
            from pyworker.worker import Worker, WorkerConfig

            config = WorkerConfig(dsn=dsn, interval=0.1)
            worker = Worker(config, adapter, db=NoMaintenanceDatabase(dsn))
            while worker.tick().status != "idle":
                done += 1
            worker.db.close()
        else:
            model, prompt = sample_prompt()
            for _ in range(calls):
                adapter.complete(model, prompt, deadline=time.monotonic() + 30,
                                 cancel=threading.Event())
                done += 1
        proc = getattr(adapter, "_proc", None)
        if proc is not None:
            pi_mib = _vm_hwm_mib(proc.pid)
    finally:
        adapter.close()
    # VmHWM, not getrusage's ru_maxrss: the latter keeps the parent's peak across fork + exec.
    own = _vm_hwm_mib(os.getpid()) or 0.0
    return {"worker_mib": round(own, 1), "pi_mib": round(pi_mib, 1) if pi_mib else None,
            "units": done}


def measure_memory(url: str, calls: int, job_dsn: Any) -> dict[str, Any]:
    """Peak RSS of a worker with the offline adapter and with Pi. ``job_dsn`` is a callable
    returning a DSN whose jobs are ready (or None when the job machinery is missing)."""
    from pyworker.adapters.pi import pi_unavailable_reason

    out: dict[str, Any] = {}
    notes = []
    variants = ["offline"] + (["pi"] if pi_unavailable_reason() is None else [])
    for name in variants:
        dsn = job_dsn(name)
        code = ("import json, sys; from pyworker.lab.bench.worker import rss_child; "
                "print(json.dumps(rss_child(sys.argv[1], sys.argv[2], "
                "sys.argv[3] or None, int(sys.argv[4]))))")
        res = subprocess.run([sys.executable, "-c", code, name, url, dsn or "", str(calls)],
                             capture_output=True, text=True, timeout=600, check=False)
        if res.returncode != 0:
            out[f"worker ({name})"] = None
            notes.append(f"{name}: failed: {res.stderr.strip()[-300:]}")
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        unit = "jobs" if dsn else "adapter calls (no job machinery yet)"
        out[f"worker, {name} adapter (python)"] = r["worker_mib"]
        if r["pi_mib"] is not None:
            out["pi process (node)"] = r["pi_mib"]
            out["worker + pi"] = round(r["worker_mib"] + r["pi_mib"], 1)
        notes.append(f"{name}: {r['units']} {unit}")
    if "pi" not in variants:
        notes.append(f"Pi not installed: {pi_unavailable_reason()}")
    return {"status": "ok", "peak_rss_mib": out, "notes": notes}


def measure(dsn: str, *, calls: int, job_dsn: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    with fake_server() as url:
        overhead = measure_overhead(url, calls)
        memory = measure_memory(url, calls, job_dsn or (lambda _name: None))
    return overhead, memory
