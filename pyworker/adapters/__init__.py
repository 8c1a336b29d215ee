"""Model adapters behind one small interface (:class:`pyworker.adapters.base.Adapter`):
``pi`` (the Pi CLI in RPC mode), ``openai`` (a direct OpenAI-compatible HTTP call) and
``offline`` (a deterministic extractive summarizer, no network, no cost)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyworker.adapters.base import Adapter

NAMES = ("pi", "openai", "offline")


class AdapterUnavailable(RuntimeError):
    """The chosen adapter cannot run on this host (the worker does not start)."""


def make_adapter(name: str, *, pi_models: Path | None = None, pi_agent_dir: Path | None = None,
                 openai_base_url: str | None = None, prices: str | None = None) -> Adapter:
    """The adapter called ``name``, configured from the options (or their environment)."""
    if name == "offline":
        from pyworker.adapters.offline import OfflineAdapter

        return OfflineAdapter()
    if name == "pi":
        from pyworker.adapters.pi import PiAdapter, pi_unavailable_reason

        # Checked before any claim: a worker that cannot start Pi would otherwise spend the
        # claims of every job it takes on failures that are not the jobs' fault.
        reason = pi_unavailable_reason()
        if reason is not None:
            raise AdapterUnavailable(f"the pi adapter cannot run: {reason}")

        models: dict[str, Any] | None = json.loads(pi_models.read_text()) if pi_models else None
        return PiAdapter(agent_dir=pi_agent_dir, models=models)
    if name == "openai":
        from pyworker.adapters.openai_compat import OpenAIAdapter, load_prices

        adapter = OpenAIAdapter()
        if openai_base_url:
            adapter.base_url = openai_base_url
        if prices:
            adapter.prices = load_prices(prices)
        return adapter
    raise ValueError(f"unknown model adapter {name!r}; choose one of {', '.join(NAMES)}")
