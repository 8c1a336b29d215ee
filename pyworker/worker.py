"""The worker loop: maintenance, claim one job, call the model, checkpoint, commit; repeat.

Every rule lives in the database; the worker only carries. One tick handles one job under a
90-second deadline; the model call gets what is left of it minus a margin for the checkpoint and
commit, and a heartbeat thread extends the two-minute lease while the call runs. SIGTERM or
SIGINT aborts the call in flight, reports the attempt truthfully (``unknown`` once the provider
may have run) and ends the loop; a second signal exits at once. Several workers may run at once:
the database hands each job to one of them. A lost connection is retried with a backoff.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg

from pyworker import errors, metrics
from pyworker.adapters.base import Adapter, ModelFailure
from pyworker.db import Database, DatabaseUnavailable
from pyworker.logs import event
from pyworker.payload import UNKNOWN_USAGE, ClaimPayload, ReplyError, reply_object
from pyworker.prompting import build_prompt


@dataclass
class WorkerConfig:
    dsn: str
    interval: float = 60.0  # seconds between checks when there is no work
    tick_seconds: float = 90.0  # the deadline of one tick
    commit_margin: float = 10.0  # kept from the model call for checkpoint and commit
    lease_every: float = 30.0  # heartbeat period (the lease is two minutes)
    workspace_id: str | None = None  # maintenance of one workspace only (default: all)
    maintenance: bool = True  # False when pg_cron runs maintenance (docs/operations.md)
    route: bool = True  # on Citus, calls to the workspace's node (docs/scaling.md, Routing)
    worker_id: str = field(default_factory=lambda: (
        f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"))


@dataclass
class TickResult:
    """What one tick did: ``idle`` (no job), ``committed``, ``noop`` (committed empty output),
    ``failed``/``unknown`` (reported with fail_job), ``lost`` (someone else owns the job now),
    ``refused`` (commit refused: stale input, config change, bad output)."""

    status: str
    job_id: int | None = None
    phase: str | None = None
    detail: str = ""
    commit: dict[str, Any] | None = None


class Worker:
    def __init__(self, config: WorkerConfig, adapter: Adapter,
                 db: Database | None = None) -> None:
        self.config = config
        self.adapter = adapter
        self.db = db or Database(config.dsn, route=config.route)
        self.stop = threading.Event()
        self._abort = threading.Event()  # aborts the call in flight
        self._signals = 0
        self.jobs_done = 0
        self._walked_at: float | None = None  # when maintenance last walked the due workspaces
        self._touched: str | None = None  # the workspace of the last job handled
        self._backlog = False  # the last walk left expired text for the next one
        # The workspaces maintained since the last no_work report: what it reads.
        self._maintained: set[str] = set()

    def maintain(self) -> dict[str, Any]:
        """Walks the due workspaces once per ``interval``, and again at once while the
        retention sweep has a backlog (it erases a batch per workspace per walk); in between,
        maintains only the workspace of the last job, so that the work its commit calls for (a
        consolidation) is scheduled at once without a walk for every job."""
        backlog, self._backlog = self._backlog, False
        if not self.config.maintenance:
            return {}
        if self.config.workspace_id is not None:
            counts = self.db.run_maintenance(self.config.workspace_id)
            self._backlog = bool(counts.get("sweep_backlog"))
            return self._note_maintained(counts)
        now = time.monotonic()
        if self._walked_at is None or backlog or now - self._walked_at >= self.config.interval:
            counts = self.db.run_maintenance(None)
            self._walked_at, self._touched = now, None
            self._backlog = bool(counts.get("sweep_backlog"))
            return self._note_maintained(counts)
        if self._touched is not None:
            counts = self.db.run_maintenance(self._touched)
            self._touched = None  # only once it ran: a lost connection tries again
            return self._note_maintained(counts)
        return {}

    def _note_maintained(self, counts: dict[str, Any]) -> dict[str, Any]:
        """Keeps the workspaces a tick visited (what the next ``no_work`` report reads) and
        answers the counts alone."""
        self._maintained.update(counts.pop("maintained", None) or ())
        return counts

    def _log(self, name: str, level: int = logging.INFO, **fields: Any) -> None:
        event(name, level, worker_id=self.config.worker_id, adapter=self.adapter.name, **fields)
        metrics.observe(name, self.adapter.name, fields)  # counters follow the log events

    # signals ---------------------------------------------------------------------------------

    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        self._signals += 1
        if self._signals > 1:
            self._log("stop_forced", logging.WARNING, signal=signum)
            os._exit(128 + (signum or 15))
        self._log("stop_requested", signal=signum)
        self.stop.set()
        self._abort.set()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    # the loop --------------------------------------------------------------------------------

    def run(self, *, until_idle: bool = False, max_jobs: int | None = None) -> int:
        """Runs until stopped (or, with ``until_idle``, until no job is left). Returns the exit
        status: 0, or 1 when a one-shot run (``until_idle``) could not reach the database or
        stopped on errors.

        Nothing a provider sends and no error of a tick ends a long-running loop: a lost
        database is retried with a backoff, and any other error is logged and the loop goes on
        after the same backoff (the database already closed or will close the attempt
        truthfully). A one-shot run is for cron and CI: it does not wait for a database that
        does not answer, and stops after five errors in a row."""
        self._log("worker_started", interval=self.config.interval,
                  tick_seconds=self.config.tick_seconds)
        backoff = 1.0
        errors_in_a_row = 0
        status = 0
        try:
            while not self.stop.is_set():
                try:
                    result = self.tick()
                    backoff, errors_in_a_row = 1.0, 0
                except DatabaseUnavailable as exc:
                    if until_idle:
                        self._log("database_unavailable", logging.ERROR, error=str(exc))
                        status = 1
                        break
                    self._log("database_unavailable", logging.WARNING, error=str(exc),
                              retry_in=backoff)
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, self.config.interval)
                    continue
                except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                    errors_in_a_row += 1
                    self._log("tick_error", logging.ERROR, error_type=type(exc).__name__,
                              error=_bounded(exc), retry_in=backoff)
                    if until_idle and errors_in_a_row >= 5:
                        status = 1
                        break  # a one-shot run does not spin on a persistent error
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, self.config.interval)
                    continue
                if result.status != "idle":
                    self.jobs_done += 1
                    if max_jobs is not None and self.jobs_done >= max_jobs:
                        break
                    continue  # work may remain: claim again at once
                if self._backlog:
                    continue  # expired text is left: the next walk sweeps on at once
                if not self.stop.is_set():
                    self.report_waiting()
                if until_idle:
                    break
                self.stop.wait(self.config.interval)
        finally:
            self.adapter.close()
            self.db.close()
            self._log("worker_stopped", jobs=self.jobs_done)
        return status

    def report_waiting(self) -> dict[str, int]:
        """Logs ``no_work`` with what waits to become a memory, by reason, as the database
        counts it (``memory.waiting_status``, the scheduler's own verdict), and when the
        earliest of it moves on by itself: in the workspaces maintained since the last report
        (a change or a foreseen event made them due), one at a time, so an idle worker reads
        no workspace that nothing touched. Informational: a database that cannot answer (an
        older schema, a lost connection) only leaves the counts out."""
        workspaces, self._maintained = sorted(self._maintained), set()
        rows: list[dict[str, Any]] = []
        try:
            for workspace_id in workspaces:
                rows += self.db.waiting(workspace_id)
        except (DatabaseUnavailable, errors.MemoryError_, psycopg.Error) as exc:
            self._log("no_work", waiting_unknown=_bounded(exc))
            return {}
        waiting: dict[str, int] = {}
        for row in rows:
            waiting[row["reason"]] = waiting.get(row["reason"], 0) + int(row["conversations"])
        next_change = min((r["next_change_at"] for r in rows if r["next_change_at"]),
                          default=None)
        self._log("no_work", workspaces=len(workspaces), waiting=waiting,
                  next_change_at=next_change)
        return waiting

    def tick(self) -> TickResult:
        """Maintenance, then at most one job, within the tick deadline."""
        start = time.monotonic()
        deadline = start + self.config.tick_seconds
        try:
            counts = self.maintain()
        except DatabaseUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - jobs are still claimed and handled
            self._log("maintenance_failed", logging.ERROR, error_type=type(exc).__name__,
                      error=_bounded(exc))
            counts = {}
        if counts and any(counts.values()):
            self._log("maintenance", counts=counts)
        if self.stop.is_set():
            return TickResult("idle")
        raw = self.db.claim_job(self.config.worker_id)
        if raw is None:
            return TickResult("idle")
        try:
            job = ClaimPayload.model_validate(raw)
        except ValueError as exc:
            return self._unreadable_claim(raw, exc)
        self._touched = job.workspace_id
        ids = job.log_fields()
        self._log("job_claimed", attempt=job.attempt, model=job.model.qualified,
                  resumed=job.checkpoint is not None, **ids)
        self._abort.clear()
        if self.stop.is_set():
            self._abort.set()
        if job.checkpoint is not None:
            return self._commit(job, ids)
        return self._attempt(job, ids, deadline)

    def _unreadable_claim(self, raw: Any, exc: Exception) -> TickResult:
        """A claim payload the worker cannot read: give the job back (no model call was made,
        so the claim does not count) and go on."""
        self._log("claim_unreadable", logging.ERROR, error=_bounded(exc))
        if isinstance(raw, dict) and {"workspace_id", "job_id", "token"} <= raw.keys():
            try:
                self.db.fail_job(str(raw["workspace_id"]), int(raw["job_id"]), str(raw["token"]),
                                 "failed", "worker_error", None)
            except (errors.MemoryError_, psycopg.Error, ValueError, TypeError) as err:
                self._log("fail_not_recorded", logging.WARNING, error=_bounded(err))
        return TickResult("failed", None, None, "worker_error")

    def _attempt(self, job: ClaimPayload, ids: dict[str, Any], deadline: float) -> TickResult:
        db = self.db
        try:
            prompt = build_prompt(job)
            reserve = self.adapter.reserve_usd(job.model, prompt)
        except ModelFailure as exc:
            self._log("before_call", logging.WARNING, error=_bounded(exc.message), **ids)
            return self._fail(job, ids, "failed", exc.code, None)
        except Exception as exc:  # noqa: BLE001 - nothing was called: give the claim back
            self._log("before_call", logging.ERROR, error_type=type(exc).__name__,
                      error=_bounded(exc), **ids)
            return self._fail(job, ids, "failed", "worker_error", None)
        try:
            attempt = db.start_attempt(job.workspace_id, job.job_id, job.token, reserve)
        except errors.BudgetExceeded as exc:
            self._log("budget_exceeded", logging.WARNING, error=exc.message, **ids)
            return self._fail(job, ids, "failed", "budget_exceeded", None)
        except (errors.JobLost, errors.JobState, errors.JobStale,
                errors.JobConfigChanged) as exc:
            self._log("job_lost", logging.WARNING, code=exc.code, error=exc.message, **ids)
            return TickResult("lost", job.job_id, job.phase, exc.message)
        self._log("model_call", attempt=attempt, reserve_usd=str(reserve),
                  timeout_s=round(deadline - self.config.commit_margin - time.monotonic(), 1),
                  **ids)
        # From here an attempt is open: whatever happens, it is closed truthfully, with what
        # can be known of its usage (the database charges at most the reserve).
        usage: dict[str, Any] | None = None
        try:
            began = time.monotonic()
            lease_lost, finished = threading.Event(), threading.Event()
            heartbeat = threading.Thread(target=self._heartbeat,
                                         args=(job, finished, lease_lost),
                                         daemon=True, name="lease-heartbeat")
            heartbeat.start()
            try:
                reply = self.adapter.complete(job.model, prompt,
                                              deadline=deadline - self.config.commit_margin,
                                              cancel=self._abort)
            except ModelFailure as exc:
                failed_usage = exc.usage.as_json() if exc.usage else None
                self._log("model_failed", logging.WARNING, outcome=exc.outcome, code=exc.code,
                          error=_bounded(exc.message), **ids)
                if lease_lost.is_set():
                    return self._fail(job, ids, exc.outcome, "lease_lost", failed_usage)
                return self._fail(job, ids, exc.outcome, exc.code, failed_usage)
            finally:
                finished.set()
                heartbeat.join(5)
            usage = reply.usage.as_json()
            self._log("model_reply", seconds=round(time.monotonic() - began, 3), usage=usage,
                      **ids)
            try:
                output = reply_object(reply.text)
            except ReplyError as exc:
                self._log("reply_refused", logging.WARNING, code=exc.code, error=_bounded(exc),
                          **ids)
                return self._fail(job, ids, "failed", exc.code, usage)
            # The database is the verdict on the output (MB023) and on the usage (MB001).
            try:
                db.save_checkpoint(job.workspace_id, job.job_id, job.token, output, usage)
            except errors.BadModelOutput as exc:
                self._log("output_refused", logging.WARNING, code=exc.code,
                          error=_bounded(exc.message), **ids)
                return self._fail(job, ids, "failed", "output_refused", usage)
            except errors.InvalidArgument as exc:
                # The usage the provider reported is not one the database can charge (a
                # negative or fractional count, a count or cost out of range): reported with
                # its usage unknown, so the database charges the reserve.
                self._log("usage_refused", logging.WARNING, code=exc.code,
                          error=_bounded(exc.message), usage=usage, **ids)
                return self._fail(job, ids, "failed", "reply_unreadable",
                                  UNKNOWN_USAGE.as_json())
            except errors.JobStale as exc:
                # A source changed during the call: the output could never be committed and may
                # carry the text that changed, so nothing was stored; the attempt is closed as
                # failed with its usage, and maintenance supersedes the job.
                self._log("input_changed", logging.WARNING, code=exc.code,
                          error=_bounded(exc.message), **ids)
                return self._fail(job, ids, "failed", "input_changed", usage)
            except (errors.JobLost, errors.JobState, errors.JobConfigChanged) as exc:
                self._log("job_lost", logging.WARNING, code=exc.code, error=exc.message, **ids)
                return TickResult("lost", job.job_id, job.phase, exc.message)
            except psycopg.DataError as exc:
                # A value PostgreSQL cannot hold (a NUL character, a lone surrogate, JSON nested
                # too deep): the output is refused before any function runs.
                self._log("output_refused", logging.WARNING, code=exc.sqlstate,
                          error=_bounded(exc), **ids)
                return self._fail(job, ids, "failed", "output_refused", usage)
        except DatabaseUnavailable:
            raise  # the attempt stays open: its lease decides (unknown, charged the reserve)
        except (errors.MemoryError_, psycopg.Error) as exc:
            self._log("database_error", logging.ERROR, error_type=type(exc).__name__,
                      error=_bounded(exc), **ids)
            return self._fail(job, ids, "failed", "database_error", usage)
        except Exception as exc:  # noqa: BLE001 - never leave an attempt open
            self._log("worker_error", logging.ERROR, error_type=type(exc).__name__,
                      error=_bounded(exc), **ids)
            # Before the reply was read the provider may have run: its cost is not known, and
            # the database charges the reserve for it.
            return self._fail(job, ids, "failed", "worker_error",
                              usage if usage is not None else UNKNOWN_USAGE.as_json())
        self._log("checkpoint_saved", **ids)
        return self._commit(job, ids)

    def _commit(self, job: ClaimPayload, ids: dict[str, Any]) -> TickResult:
        try:
            result = self.db.commit_job(job.workspace_id, job.job_id, job.token)
        except errors.JobLost as exc:
            self._log("job_lost", logging.WARNING, error=exc.message, **ids)
            return TickResult("lost", job.job_id, job.phase, exc.message)
        except errors.MemoryError_ as exc:
            # Stale input (MB021), changed configuration (MB022), refused output: nothing was
            # written, and the attempt was already charged with the checkpoint. The database
            # supersedes or stops the job from its own facts; the worker just drops the work.
            self._log("commit_refused", logging.WARNING, code=exc.code, error=exc.message, **ids)
            return TickResult("refused", job.job_id, job.phase, f"{exc.code}: {exc.message}")
        except psycopg.Error as exc:
            # An unexpected database error: the job keeps its checkpoint and is committed by a
            # later claim, without another model call.
            self._log("database_error", logging.ERROR, error_type=type(exc).__name__,
                      error=_bounded(exc), **ids)
            return self._fail(job, ids, "failed", "database_error", None)
        status = "noop" if isinstance(result, dict) and result.get("noop") else "committed"
        self._log("job_committed", result=result, **ids)
        return TickResult(status, job.job_id, job.phase, commit=result)

    def _fail(self, job: ClaimPayload, ids: dict[str, Any], outcome: str, code: str,
              usage: dict[str, Any] | None) -> TickResult:
        self._report(job, ids, outcome, code, usage)
        return TickResult(outcome, job.job_id, job.phase, code)

    def _report(self, job: ClaimPayload, ids: dict[str, Any], outcome: str, code: str,
                usage: dict[str, Any] | None) -> None:
        """fail_job with the failure code and the usage that could be read. Should the
        database refuse that usage, the attempt is reported again with its usage unknown (the
        database charges the reserve); should that fail too, the lease decides."""
        self._log("job_failed", logging.WARNING, outcome=outcome, error=code, usage=usage, **ids)
        for attempt_usage in (usage, UNKNOWN_USAGE.as_json() if usage is not None else None):
            try:
                state = self.db.fail_job(job.workspace_id, job.job_id, job.token, outcome, code,
                                         attempt_usage)
            except errors.InvalidArgument as exc:
                self._log("fail_not_recorded", logging.WARNING, code=exc.code,
                          error=exc.message, **ids)
                if attempt_usage is None:
                    return
                continue
            except errors.MemoryError_ as exc:
                # Lost the job meanwhile: the database already decided (an expired lease with
                # an open attempt is unknown there too).
                self._log("fail_not_recorded", logging.WARNING, code=exc.code,
                          error=exc.message, **ids)
                return
            except psycopg.Error as exc:
                self._log("fail_not_recorded", logging.ERROR, error_type=type(exc).__name__,
                          error=_bounded(exc), **ids)
                return
            if state.get("status") == "stopped":
                self._log("job_stopped", logging.WARNING, why=state.get("why"), **ids)
            return

    def _heartbeat(self, job: ClaimPayload, done: threading.Event,
                   lost: threading.Event) -> None:
        """Extends the lease every ``lease_every`` seconds while the call runs (own connection);
        aborts the call when the lease is lost."""
        db = self.db.sibling("pimem-worker-heartbeat")  # the job's route, its own connection
        try:
            while not done.wait(self.config.lease_every):
                try:
                    until = db.extend_lease(job.workspace_id, job.job_id, job.token)
                    self._log("lease_extended", until=until, **job.log_fields())
                except DatabaseUnavailable as exc:
                    self._log("lease_not_extended", logging.WARNING, error=str(exc),
                              **job.log_fields())
                except errors.MemoryError_ as exc:
                    self._log("lease_lost", logging.WARNING, code=exc.code, error=exc.message,
                              **job.log_fields())
                    lost.set()
                    self._abort.set()
                    return
        finally:
            db.close()


def _bounded(value: object, limit: int = 300) -> str:
    """A message for the worker's log: at most ``limit`` characters, control characters
    replaced (it may quote a provider or a model)."""
    text = str(value)[:limit]
    return "".join("?" if unicodedata.category(c) in ("Cc", "Cs") else c for c in text)
