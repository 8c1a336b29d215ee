"""``pimem worker`` whose commit stalls: the fault the crash tests inject from the test side.

Run as ``python -m tests.stalled_commit_worker worker --dsn ...`` (the arguments of
``pimem worker``). Every ``commit_job`` logs ``commit_stalled`` and sleeps for a minute before it
commits, so a test can kill the worker between the checkpoint and the commit; the worker loop
itself carries no hook for it.
"""

from __future__ import annotations

import time
from typing import Any

from pyworker import logs
from pyworker.cli import app
from pyworker.db import Database

STALL_SECONDS = 60.0
_commit_job = Database.commit_job


def stalled_commit_job(self: Database, workspace_id: str, job_id: int,
                       token: str) -> dict[str, Any]:
    logs.event("commit_stalled", seconds=STALL_SECONDS, job_id=job_id)
    time.sleep(STALL_SECONDS)
    return _commit_job(self, workspace_id, job_id, token)


if __name__ == "__main__":
    Database.commit_job = stalled_commit_job  # type: ignore[method-assign]
    app()
