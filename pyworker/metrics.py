"""Prometheus metrics of the worker, on an opt-in port (``pimem worker --metrics-port 9464``).

The metrics are derived from the worker's structured log events (``Worker._log`` hands every
event to :func:`observe`), so a log line and a counter can never disagree about what happened.
Labels are low-cardinality only (phase, adapter, outcome, error code); workspace, job and
request ids are in the JSON logs, not in metric labels.

Exposed (prometheus_client appends ``_total`` to counters):

==========================================  =====================================================
``pimem_jobs_claimed_total{phase}``          claims made (a resumed checkpoint counts too)
``pimem_jobs_committed_total{phase}``        commits (an empty extraction no-op counts too)
``pimem_jobs_failed_total{phase,outcome}``   claims reported with ``fail_job``: failed | unknown
``pimem_jobs_stopped_total{phase,why}``      of those, the ones the database stopped (fail_job's
                                             answer): unknown_outcome | third_claim
``pimem_jobs_refused_total{phase,code}``     commits the database refused (MB021 stale input,
                                             MB022 config changed, ...): the work is dropped
``pimem_jobs_lost_total{phase}``             claims lost to an expired lease or another worker
``pimem_model_call_seconds{adapter,phase,result}``  model call latency (histogram)
``pimem_model_tokens_total{adapter,phase,kind}``    tokens the provider reported (input|output)
``pimem_model_cost_usd_total{adapter,phase}``       dollars the provider reported
``pimem_database_unavailable_total``         ticks lost to a database that did not answer
==========================================  =====================================================

Dollars here are what the provider reported for calls whose outcome is known; the database
charges an ``unknown`` call at its reserve (``memory.request_memory_charges`` is the ledger).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS_CLAIMED = Counter("pimem_jobs_claimed", "Memory jobs claimed by this worker.",
                       ["phase"], registry=REGISTRY)
JOBS_COMMITTED = Counter("pimem_jobs_committed", "Memory jobs committed by this worker.",
                         ["phase"], registry=REGISTRY)
JOBS_FAILED = Counter("pimem_jobs_failed",
                      "Claims reported with fail_job, by outcome (failed | unknown).",
                      ["phase", "outcome"], registry=REGISTRY)
JOBS_STOPPED = Counter("pimem_jobs_stopped",
                       "Failed claims that stopped their job (no automatic replay): "
                       "why = unknown_outcome | third_claim.",
                       ["phase", "why"], registry=REGISTRY)
JOBS_REFUSED = Counter("pimem_jobs_refused",
                       "Commits the database refused (stale input, config changed, ...).",
                       ["phase", "code"], registry=REGISTRY)
JOBS_LOST = Counter("pimem_jobs_lost", "Claims lost (lease expired or another owner).",
                    ["phase"], registry=REGISTRY)
MODEL_SECONDS = Histogram("pimem_model_call_seconds",
                          "Model call latency in seconds, by result (ok | failed | unknown).",
                          ["adapter", "phase", "result"], registry=REGISTRY,
                          buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 90))
MODEL_TOKENS = Counter("pimem_model_tokens", "Tokens the provider reported, by kind.",
                       ["adapter", "phase", "kind"], registry=REGISTRY)
MODEL_COST = Counter("pimem_model_cost_usd", "Dollars the provider reported.",
                     ["adapter", "phase"], registry=REGISTRY)
DATABASE_UNAVAILABLE = Counter("pimem_database_unavailable",
                               "Ticks lost to a database that did not answer.",
                               registry=REGISTRY)

# Per job in hand: when the model call began.
_calls: dict[int, float] = {}
_lock = threading.Lock()


def _usage(adapter: str, phase: str, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for kind in ("input", "output"):
        tokens = usage.get(f"{kind}_tokens") or 0
        if tokens > 0:
            MODEL_TOKENS.labels(adapter, phase, kind).inc(tokens)
    cost = float(usage.get("cost_usd") or 0)
    if cost > 0:
        MODEL_COST.labels(adapter, phase).inc(cost)


def observe(name: str, adapter: str, fields: dict[str, Any]) -> None:
    """Counts one worker log event (``job_claimed``, ``model_reply``, ``job_failed``, ...)."""
    phase = str(fields.get("phase") or "none")
    job_id = fields.get("job_id")
    if name == "job_claimed":
        JOBS_CLAIMED.labels(phase).inc()
    elif name == "model_call":
        if isinstance(job_id, int):
            with _lock:
                _calls[job_id] = time.monotonic()
    elif name == "model_reply":
        with _lock:
            _calls.pop(job_id, None)  # type: ignore[arg-type]
        MODEL_SECONDS.labels(adapter, phase, "ok").observe(float(fields.get("seconds") or 0))
        _usage(adapter, phase, fields.get("usage"))
    elif name == "job_failed":
        outcome = str(fields.get("outcome") or "failed")
        JOBS_FAILED.labels(phase, outcome).inc()
        with _lock:
            began = _calls.pop(job_id, None)  # type: ignore[arg-type]
        if began is not None:  # the call itself failed: its usage is not counted yet
            MODEL_SECONDS.labels(adapter, phase, outcome).observe(time.monotonic() - began)
            _usage(adapter, phase, fields.get("usage"))
    elif name == "job_stopped":  # the database's answer to fail_job, not a rule of ours
        JOBS_STOPPED.labels(phase, str(fields.get("why") or "unknown")).inc()
    elif name == "job_committed":
        JOBS_COMMITTED.labels(phase).inc()
        _forget(job_id)
    elif name == "commit_refused":
        JOBS_REFUSED.labels(phase, str(fields.get("code") or "unknown")).inc()
        _forget(job_id)
    elif name == "job_lost":
        JOBS_LOST.labels(phase).inc()
        _forget(job_id)
    elif name == "database_unavailable":
        DATABASE_UNAVAILABLE.inc()


def _forget(job_id: Any) -> None:
    with _lock:
        _calls.pop(job_id, None)


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Starts the ``/metrics`` HTTP endpoint in a daemon thread; returns the bound port (pass
    0 for any free port)."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return int(server.server_port)
