"""Test order under xdist: the long tests first, spread over the workers, and work stealing.

The suite's wall time is the busiest worker's. A 70-second test that starts last on one worker
keeps the run going long after the other worker is done, so:

- every run records each test's duration (setup, call and teardown) in pytest's cache
  (``.pytest_cache``, key ``pimem/durations``); a slow test not recorded yet counts as
  ``SLOW_DEFAULT`` seconds;
- with N workers, the collection is cut into N consecutive segments of the sizes xdist's work
  stealing hands out first; the tests marked ``slow`` are dealt over the segments longest first,
  each to the segment with the least time so far, and start their segment; the other tests fill
  the segments in their usual order (so a module's fixtures are still set up once per worker);
- the run uses xdist's ``worksteal`` scheduling unless ``--dist`` is given: a worker that runs
  out of tests takes the second half of the busiest worker's queue (its quick tests).

Without xdist nothing is reordered. No test depends on the order: each starts from a fresh
clone or from the shared database reset to one.
"""

from __future__ import annotations

from typing import Any

import pytest

CACHE_KEY = "pimem/durations"
SLOW_DEFAULT = 30.0  # seconds, for a slow test no run has recorded yet


def _workers(config: pytest.Config) -> int:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 1


def _segment_sizes(total: int, workers: int) -> list[int]:
    """The sizes xdist's work stealing hands out first: consecutive, ``left // nodes_left``."""
    sizes, left = [], total
    for k in range(workers):
        size = left // (workers - k)
        sizes.append(size)
        left -= size
    return sizes


def order_for_workers(items: list[Any], seconds: dict[str, float], slow: set[str],
                      workers: int) -> list[Any]:
    """The items in segments, one per worker, each starting with its share of the slow tests."""
    sizes = _segment_sizes(len(items), workers)
    weight = {i.nodeid: seconds.get(i.nodeid, SLOW_DEFAULT) for i in items if i.nodeid in slow}
    long_items = sorted((i for i in items if i.nodeid in slow), key=lambda i: -weight[i.nodeid])
    heads: list[list[Any]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in long_items:
        open_segments = [k for k in range(workers) if len(heads[k]) < sizes[k]]
        k = min(open_segments, key=lambda s: load[s])
        heads[k].append(item)
        load[k] += weight[item.nodeid]
    placed = {i.nodeid for i in long_items}
    rest = iter(i for i in items if i.nodeid not in placed)
    ordered: list[Any] = []
    for k in range(workers):
        ordered += heads[k]
        ordered += [next(rest) for _ in range(sizes[k] - len(heads[k]))]
    return ordered


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = _workers(config)
    if workers < 2:
        return
    cache = getattr(config, "cache", None)
    seconds: dict[str, float] = cache.get(CACHE_KEY, {}) if cache is not None else {}
    slow = {i.nodeid for i in items if i.get_closest_marker("slow") is not None}
    items[:] = order_for_workers(items, seconds, slow, workers)


class _Durations:
    """Collects each test's duration on the controller (or the only process) and merges them
    into the cache at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(session.config, "cache", None)
        if cache is None or not self.seconds:
            return
        known: dict[str, float] = cache.get(CACHE_KEY, {})
        known.update({k: round(v, 2) for k, v in self.seconds.items()})
        cache.set(CACHE_KEY, known)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None:  # the controller, or a run without xdist
        config.pluginmanager.register(_Durations(), "pimem-durations")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    given = any(a == "--dist" or a.startswith("--dist=")
                for a in config.invocation_params.args)
    if given or config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)
