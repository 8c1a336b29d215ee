"""``pimem telegram`` itself: the installed command, configured by the environment, against the
fake Bot API and the fake chat model; and what it says when it cannot start."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker.cli import app
from tests.fake_chat import FakeChat
from tests.fake_telegram import FakeTelegram
from tests.telegram_world import CALL_COST, PRICES

PIMEM = Path(sys.executable).parent / "pimem"


def environment(tg: FakeTelegram, chat: FakeChat, dsn: str, state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIMEM_")}
    env.update(PIMEM_TG_TOKEN=tg.token, PIMEM_DSN=dsn, PIMEM_TG_API_BASE=tg.url,
               PIMEM_TG_MODEL="fake/m", PIMEM_TG_MODEL_URL=chat.url,
               PIMEM_TG_MODEL_KEY="test-key", PIMEM_PRICES=PRICES,
               PIMEM_TG_POLLING_TIMEOUT="1", PIMEM_TG_WORKSPACE_PREFIX="ci",
               PIMEM_TG_STATE_DIR=str(state))
    return env


def events(stderr: str) -> list[dict[str, Any]]:
    found = []
    for line in stderr.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "event" in value:
            found.append(value)
    return found


@pytest.mark.slow  # the bot as a process
def test_pimem_telegram_answers_through_the_fake_bot_api_and_stops_on_sigterm(
        conn: psycopg.Connection, db_dsn: str, tmp_path: Path) -> None:
    with FakeTelegram() as tg, FakeChat() as chat:
        proc = subprocess.Popen([str(PIMEM), "telegram"],
                                env=environment(tg, chat, db_dsn, tmp_path / "state"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            alice = tg.user(101, "Alice")
            msg = tg.message(tg.private(alice), alice, "hello from the command")
            [answer] = tg.wait_sent(1, timeout=120)
            assert answer["text"] == "You said: hello from the command"
            tg.wait(lambda: tg.confirmed > msg["message_id"], 60, "the update confirmed")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    row = conn.execute("select status, spent_usd from memory_private.requests "
                       "where workspace_id = 'ci:user:101'").fetchone()
    assert row == ("succeeded", CALL_COST)
    names = [e["event"] for e in events(err)]
    assert names[0] == "telegram_started" and names[-1] == "telegram_stopped", names
    assert "answered" in names and "update_handled" in names
    assert "getMe" in tg.methods() and "deleteWebhook" in tg.methods()


def test_pimem_telegram_says_which_setting_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("PIMEM_")]:
        monkeypatch.delenv(name)
    runner = CliRunner()
    result = runner.invoke(app, ["telegram"], env={"PIMEM_TG_TOKEN": "1:x"})
    assert result.exit_code == 2
    # every missing setting at once, the given one not among them
    for name in ("PIMEM_DSN", "PIMEM_TG_MODEL", "PIMEM_PRICES"):
        assert f"{name} is not set" in result.output, name
    assert "PIMEM_TG_TOKEN" not in result.output
    result = runner.invoke(app, ["telegram", "--dsn", "postgresql:///x"], env={
        "PIMEM_TG_TOKEN": "1:x", "PIMEM_TG_MODEL": "openai/gpt-4o-mini",
        "PIMEM_PRICES": '{"openai/gpt-4o": {"input": 2.5, "output": 10}}'})
    assert result.exit_code == 2
    assert "PIMEM_PRICES has no price for openai/gpt-4o-mini" in result.output


def test_pimem_telegram_says_when_it_cannot_keep_its_state(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [k for k in os.environ if k.startswith("PIMEM_")]:
        monkeypatch.delenv(name)
    (tmp_path / "a-file").write_text("not a directory")
    state = tmp_path / "a-file" / "state"
    result = CliRunner().invoke(app, ["telegram"], env={
        "PIMEM_TG_TOKEN": "1:x", "PIMEM_DSN": "host=127.0.0.1 port=1 dbname=none",
        "PIMEM_TG_MODEL": "fake/m", "PIMEM_PRICES": PRICES,
        "PIMEM_TG_API_BASE": "http://127.0.0.1:1", "PIMEM_TG_STATE_DIR": str(state)})
    assert result.exit_code == 2, "a configuration to fix, not a restart loop"
    assert f"PIMEM_TG_STATE_DIR: the bot cannot keep its state in {state}" in result.output


def test_pimem_telegram_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiogram" else real(name, *a))
    result = CliRunner().invoke(app, ["telegram"])
    assert result.exit_code == 2
    assert "pip install 'pimem[telegram]'" in result.output


def test_the_worker_and_the_cli_never_import_aiogram() -> None:
    probe = ("import sys, pyworker.cli, pyworker.worker, pyworker.client\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiogram', 'aiohttp')"
             " or m.startswith('pyworker.contrib.telegram')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
