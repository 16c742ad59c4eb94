"""Secrets never leave the process: every configured secret is masked wherever ingest prints or logs.

Adapters already build their messages from drivers' diagnostic text, never from
DSNs. That is not enough on its own: libpq quotes the token it cannot parse,
and a token of a malformed DSN can be (a piece of) the password; a connection
pool logs the driver's message on every reconnect. So, as a second line:

- :func:`register_settings` collects every secret of a loaded configuration --
  each ``SecretStr`` value, the secret-looking librdkafka settings, and the
  password of every DSN in every form a message could show it (raw, percent-
  decoded, quoted or not, and the pieces of an unquoted password with spaces);
- :func:`scrub` replaces each of them in a text with ``**********``;
- :class:`RedactingFilter`, installed on the log handler, scrubs every record
  (message, extra fields, traceback) before it is formatted.

Secrets shorter than :data:`MIN_SECRET` characters are not registered (masking
every "ab" in every line would be worse than useless). Record bytes stored in
the DLQ are never changed; error messages stored with them are scrubbed.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, SecretStr

MASK = "**********"
MIN_SECRET = 3

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()
_URL_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")
_KV_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*", re.IGNORECASE)
_KV_NEXT = re.compile(r"\s+[A-Za-z_][A-Za-z0-9_]*\s*=")
_SECRET_CLIENT_KEYS = ("password", "secret", "sasl.oauthbearer.config", "ssl.key.pem")


def register(*values: str) -> None:
    """Mask these strings (and nothing shorter than MIN_SECRET) in everything scrubbed from now on."""
    global _secrets
    new = {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET}
    if not new:
        return
    with _lock:
        _secrets = tuple(sorted(set(_secrets) | new, key=len, reverse=True))


def registered() -> tuple[str, ...]:
    return _secrets


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced by :data:`MASK`. Never raises."""
    secrets = _secrets
    if not secrets or not isinstance(text, str):
        return text
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def dsn_secrets(dsn: str) -> set[str]:
    """The password of a PostgreSQL DSN in every form a message could quote, leniently: the DSN
    may be malformed (that is when libpq quotes its tokens)."""
    out: set[str] = set()
    match = _URL_SCHEME.match(dsn)
    if match:
        rest = dsn[match.end():]
        at = rest.rfind("@")
        if at >= 0 and ":" in rest[:at]:
            out.add(rest[:at].split(":", 1)[1])
        for part in rest.partition("?")[2].split("&"):
            key, _, value = part.partition("=")
            if key.strip().lower() == "password":
                out.add(value)
        out |= {unquote(v) for v in out}
        return out
    for m in _KV_PASSWORD.finditer(dsn):
        tail = dsn[m.end():]
        if tail.startswith("'"):
            value, i, escaped = [], 1, False
            while i < len(tail) and (escaped or tail[i] != "'"):
                escaped = tail[i] == "\\" and not escaped
                if not escaped:
                    value.append(tail[i])
                i += 1
            out |= {"".join(value), tail[1:i]}
        else:
            nxt = _KV_NEXT.search(tail)
            value = (tail[:nxt.start()] if nxt else tail).strip()
            out.add(value)
            out |= set(value.split())  # an unquoted password with spaces: libpq quotes its pieces
    return out


def register_settings(model: Any) -> None:
    """Register every secret of a configuration (a pydantic model, walked recursively)."""
    found: list[str] = []
    _collect(model, found, "")
    register(*found)


def _collect(value: Any, out: list[str], name: str) -> None:
    if isinstance(value, SecretStr):
        secret = value.get_secret_value()
        out.append(secret)
        if name.endswith("dsn"):
            out.extend(dsn_secrets(secret))
    elif isinstance(value, BaseModel):
        for field in type(value).model_fields:
            _collect(getattr(value, field), out, field)
        if name == "kafka" or hasattr(value, "client_config"):
            client = getattr(value, "client", {}) or {}
            out.extend(str(v) for k, v in client.items() if any(s in k for s in _SECRET_CLIENT_KEYS))
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect(item, out, str(key))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out, name)


_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class RedactingFilter(logging.Filter):
    """Scrubs every log record (message, extra fields, traceback) before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: log it as it is
            message = str(record.msg)
        record.msg, record.args = scrub(message), ()
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD and isinstance(value, str):
                record.__dict__[key] = scrub(value)
        if record.exc_info:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True
