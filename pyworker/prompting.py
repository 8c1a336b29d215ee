"""Builds the model prompt of a claimed job from the text files in ``pyworker/prompts/``.

The job's inputs go into the prompt's DATA block as the claim carries them: the database redacted
credentials in them before it serialized the claim (``memory_private.job_payload``, P8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from string import Template
from typing import Any

from pyworker.payload import ClaimPayload, ConsolidateInput, ExtractInput, Limits, Phase


@cache
def template(name: str) -> str:
    return resources.files("pyworker").joinpath("prompts", f"{name}.txt").read_text("utf-8")


@dataclass(frozen=True)
class Prompt:
    """What an adapter sends: a system prompt, one user message, and the structured input
    (which the offline summarizer reads instead of the text)."""

    phase: Phase
    system: str
    user: str
    data: ExtractInput | ConsolidateInput
    limits: Limits


def job_input(payload: ClaimPayload) -> ExtractInput | ConsolidateInput:
    if payload.phase == "extract":
        return payload.extract_input()
    return payload.consolidate_input()


def _data_json(data: ExtractInput | ConsolidateInput) -> str:
    value: dict[str, Any] = data.model_dump(mode="json")
    return json.dumps(value, ensure_ascii=False, indent=1)


def build_prompt(payload: ClaimPayload) -> Prompt:
    data = job_input(payload)
    lim = payload.limits
    body = Template(template(payload.phase)).substitute(
        data=_data_json(data), title_bytes=lim.title_bytes, summary_bytes=lim.summary_bytes,
        index_bytes=lim.index_bytes, index_ids=lim.index_ids, candidates=lim.candidates)
    return Prompt(phase=payload.phase, system=template("system").strip(), user=body, data=data,
                  limits=lim)
