"""The bot's configuration, read from the environment (docs/telegram.md lists every variable)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pyworker.adapters.openai_compat import Price, load_prices
from pyworker.payload import ModelRef

# Telegram accepts 1-256 characters of A-Z, a-z, 0-9, _ and - as a webhook secret.
SECRET = re.compile(r"[A-Za-z0-9_-]{1,256}")


class SettingsError(ValueError):
    """A variable is missing or malformed; the message names it."""


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the bot keeps what the database has not taken yet (``PIMEM_TG_STATE_DIR``):
    ``$XDG_STATE_HOME/pimem``, else ``~/.local/state/pimem``."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".local" / "state") / "pimem"


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    token: str
    dsn: str
    api_base: str | None = None  # a local Bot API server (or the tests' fake); None: Telegram's
    model: ModelRef
    model_url: str = "https://api.openai.com/v1"
    model_key: str | None = None
    price: Price
    workspace_prefix: str = "tg"
    bot_id: str = "telegram"
    config_version: int = 1
    workspace_budget_usd: Decimal = Decimal(10)
    request_budget_usd: Decimal = Decimal("0.50")
    idle_minutes: int = 30
    retain_days: int | None = None
    max_tool_rounds: int = 4
    model_timeout: float = 60.0
    mode: Literal["polling", "webhook"] = "polling"
    polling_timeout: int = 30
    webhook_url: str | None = None
    webhook_host: str = "127.0.0.1"
    webhook_port: int = 8080
    webhook_secret: str = ""
    state_dir: Path = Field(default_factory=default_state_dir)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, dsn: str | None = None,
                 mode: str | None = None) -> Settings:
        """Settings from ``env`` (default: ``os.environ``); ``dsn`` and ``mode`` override it."""
        env = os.environ if env is None else env

        def get(name: str, default: str | None = None) -> str | None:
            value = env.get(name, "").strip()
            return value or default

        def need(name: str, what: str) -> str:
            value = get(name)
            if value is None:
                raise SettingsError(f"{name} is not set: {what}")
            return value

        def number(name: str, default: str, *, lo: int, hi: int) -> int:
            raw = get(name, default) or default
            if not raw.isdigit() or not lo <= int(raw) <= hi:
                raise SettingsError(f"{name} must be a whole number from {lo} to {hi}")
            return int(raw)

        def dollars(name: str, default: str) -> Decimal:
            try:
                value = Decimal(get(name, default) or default)
            except InvalidOperation:
                raise SettingsError(f"{name} must be a dollar amount") from None
            if not value.is_finite() or not 0 <= value <= 1_000_000:
                raise SettingsError(f"{name} must be a dollar amount from 0 to 1000000")
            return value

        # Every missing variable at once, not one per try.
        chosen = (mode or get("PIMEM_TG_MODE", "polling") or "polling").lower()
        required = {
            "PIMEM_TG_TOKEN": "the bot token from @BotFather",
            "PIMEM_DSN": "the memory database (role memory_backend)",
            "PIMEM_TG_MODEL": "the chat model as provider/model, e.g. openai/gpt-4o-mini",
            "PIMEM_PRICES": "the chat model's prices per million tokens, e.g. "
                            '{"openai/gpt-4o-mini": {"input": 0.15, "output": 0.6}}',
        }
        if dsn:
            del required["PIMEM_DSN"]
        if chosen == "webhook":
            required["PIMEM_TG_WEBHOOK_URL"] = ("the public https URL Telegram posts updates "
                                                "to (webhook mode)")
        missing = [f"{name} is not set: {what}" for name, what in required.items()
                   if get(name) is None]
        if missing:
            raise SettingsError("; ".join(missing))
        model_ref = need("PIMEM_TG_MODEL", "the chat model as provider/model, e.g. "
                         "openai/gpt-4o-mini")
        provider, _, model_id = model_ref.partition("/")
        if not provider or not model_id:
            raise SettingsError("PIMEM_TG_MODEL must be provider/model, e.g. openai/gpt-4o-mini")
        model = ModelRef(provider=provider, id=model_id)
        try:
            prices = load_prices(get("PIMEM_PRICES"))
        except (ValueError, KeyError, TypeError, InvalidOperation) as exc:
            raise SettingsError(f"PIMEM_PRICES is not a price table: {exc}") from None
        price = prices.get(model.qualified) or prices.get(model.id)
        if price is None:
            raise SettingsError(f"PIMEM_PRICES has no price for {model.qualified}: each answer "
                                "reports its spend, so an unpriced model is not called")
        retain = get("PIMEM_TG_RETAIN_DAYS")
        if chosen not in ("polling", "webhook"):
            raise SettingsError("PIMEM_TG_MODE must be polling or webhook")
        host, _, port = (get("PIMEM_TG_WEBHOOK_LISTEN", "127.0.0.1:8080") or "").rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise SettingsError("PIMEM_TG_WEBHOOK_LISTEN must be host:port")
        webhook_url = get("PIMEM_TG_WEBHOOK_URL")
        secret = get("PIMEM_TG_WEBHOOK_SECRET") or secrets.token_urlsafe(32)
        if not SECRET.fullmatch(secret):
            raise SettingsError("PIMEM_TG_WEBHOOK_SECRET may hold only A-Z, a-z, 0-9, _ and -, "
                                "at most 256 characters")
        prefix = get("PIMEM_TG_WORKSPACE_PREFIX", "tg") or "tg"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", prefix):
            raise SettingsError("PIMEM_TG_WORKSPACE_PREFIX may hold only letters, digits, "
                                "'_', '.' and '-' (at most 40)")
        return cls(
            token=need("PIMEM_TG_TOKEN", "the bot token from @BotFather"),
            dsn=dsn or need("PIMEM_DSN", "the memory database (role memory_backend)"),
            api_base=get("PIMEM_TG_API_BASE"),
            model=model,
            model_url=get("PIMEM_TG_MODEL_URL", "https://api.openai.com/v1")
            or "https://api.openai.com/v1",
            model_key=get("PIMEM_TG_MODEL_KEY") or get("OPENAI_API_KEY"),
            price=price,
            workspace_prefix=prefix,
            bot_id=get("PIMEM_TG_BOT_ID", "telegram") or "telegram",
            config_version=number("PIMEM_TG_CONFIG_VERSION", "1", lo=0, hi=2_000_000_000),
            workspace_budget_usd=dollars("PIMEM_TG_WORKSPACE_BUDGET_USD", "10"),
            request_budget_usd=dollars("PIMEM_TG_REQUEST_BUDGET_USD", "0.50"),
            idle_minutes=number("PIMEM_TG_IDLE_MINUTES", "30", lo=0, hi=43_200),
            retain_days=None if retain is None
            else number("PIMEM_TG_RETAIN_DAYS", retain, lo=1, hi=36_500),
            max_tool_rounds=number("PIMEM_TG_MAX_TOOL_ROUNDS", "4", lo=1, hi=16),
            model_timeout=float(number("PIMEM_TG_MODEL_TIMEOUT", "60", lo=1, hi=600)),
            mode=chosen,  # type: ignore[arg-type]
            polling_timeout=number("PIMEM_TG_POLLING_TIMEOUT", "30", lo=0, hi=60),
            webhook_url=webhook_url,
            webhook_host=host.strip("[]"),
            webhook_port=int(port),
            webhook_secret=secret,
            state_dir=Path(get("PIMEM_TG_STATE_DIR") or default_state_dir(env)),
        )
