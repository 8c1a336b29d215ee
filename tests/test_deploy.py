"""docs/deploy/: the systemd units, their environment files and the TLS proxies for the webhook
say only what the package does: each command and option exists, each variable is read, the bot's
settings load from the example, and the proxies pass the webhook's path to the address the bot
listens on."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import typer
from typer.core import TyperGroup

from pyworker.adapters import NAMES, make_adapter
from pyworker.adapters.openai_compat import load_prices
from pyworker.cli import app
from pyworker.contrib.telegram.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "docs" / "deploy"
UNITS = {"pimem-worker.service": "worker", "pimem-telegram.service": "telegram"}


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys as written
    parser.read_string((DEPLOY / name).read_text(encoding="utf-8"))
    return parser


def env_file(name: str) -> dict[str, str]:
    """An EnvironmentFile as systemd reads it: KEY=VALUE lines, a value wholly in single or
    double quotes unquoted, comments and blank lines skipped."""
    values: dict[str, str] = {}
    for line in (DEPLOY / name).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def variables_the_package_reads() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "pyworker").rglob("*.py"):
        names |= set(re.findall(r"\b(PIMEM_[A-Z0-9_]+|OPENAI_API_KEY)\b", path.read_text()))
    return names


def command(name: str) -> typer.core.TyperCommand:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    found = group.commands.get(name)
    assert found is not None, f"pimem has no command {name!r}"
    return found


@pytest.mark.parametrize("name", sorted(UNITS))
def test_each_unit_runs_a_pimem_command_with_options_it_has(name: str) -> None:
    service = unit(name)["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/bin/pimem") and argv[1] == UNITS[name]
    options = {opt for param in command(argv[1]).params for opt in param.opts}
    given = [arg for arg in argv[2:] if arg.startswith("--")]
    assert given and set(given) <= options, set(given) - options
    assert service["KillSignal"] == "SIGTERM" and service["RestartPreventExitStatus"] == "2"
    assert service["EnvironmentFile"] == f"/etc/pimem/{UNITS[name]}.env"
    assert (DEPLOY / f"{UNITS[name]}.env.example").exists()
    assert set(unit(name)) >= {"Unit", "Service", "Install"}


def test_the_worker_unit_waits_longer_than_a_tick_and_its_environment_is_read() -> None:
    ticks = {p.name: p.default for p in command("worker").params}["tick_seconds"]
    assert isinstance(ticks, float)
    assert int(unit("pimem-worker.service")["Service"]["TimeoutStopSec"]) > ticks
    env = env_file("worker.env.example")
    assert set(env) <= variables_the_package_reads(), set(env) - variables_the_package_reads()
    assert env["PIMEM_MODEL_ADAPTER"] in NAMES
    adapter = make_adapter(env["PIMEM_MODEL_ADAPTER"], prices=env["PIMEM_PRICES"])
    assert adapter.name == env["PIMEM_MODEL_ADAPTER"]
    assert load_prices(env["PIMEM_PRICES"])
    assert "user=" in env["PIMEM_DSN"]


def test_the_bot_loads_its_example_settings_and_the_proxies_reach_its_webhook() -> None:
    env = env_file("telegram.env.example")
    assert set(env) <= variables_the_package_reads(), set(env) - variables_the_package_reads()
    settings = Settings.from_env(env)
    assert settings.mode == "webhook" and settings.webhook_url is not None
    url = urlsplit(settings.webhook_url)
    assert url.scheme == "https" and (url.port or 443) in (443, 80, 88, 8443)
    target = f"{settings.webhook_host}:{settings.webhook_port}"

    caddy = (DEPLOY / "Caddyfile").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(url.hostname or '')} \{{", caddy, re.MULTILINE)
    assert f"handle {url.path} {{" in caddy and f"reverse_proxy {target}" in caddy

    nginx = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    assert f"server_name {url.hostname};" in nginx
    assert f"location = {url.path} {{" in nginx and f"proxy_pass http://{target};" in nginx
    stop = int(unit("pimem-telegram.service")["Service"]["TimeoutStopSec"])
    assert stop > 30, "the bot finishes the answers in progress for up to 30 s"
