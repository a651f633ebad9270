"""API keys and their roles: who may call which RPC.

A key has one role. ``generate``: the Generation service. ``admin``: everything, the Adapters service included
(admin implies generate). Keys come from ``--api-key-file`` (one ``ROLE:KEY`` per line, ``#`` comments and blank
lines allowed) and from ``LORAPLEX_API_KEYS`` (comma-separated, kept for compatibility: those are admin keys).
No key configured at all means no authentication. Health and reflection are always open, so probes need no key.

Invariants: a key is compared in constant time against every configured key, and never appears in a log line,
an error message or a repr.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from service.config import ConfigError, Settings
from service.errors import PermissionDenied, Unauthenticated

Role = Literal["generate", "admin"]
ROLES: tuple[Role, ...] = ("generate", "admin")
OPEN_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)
ADMIN_SERVICES = frozenset({"loraplex.v1.Adapters"})


def service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").partition("/")[0]


def required_role(method: str) -> Role | None:
    """The role a call of ``method`` (a full ``/pkg.Service/Method`` path) needs; None = open to anyone."""
    service = service_of(method)
    if service in OPEN_SERVICES:
        return None
    return "admin" if service in ADMIN_SERVICES else "generate"


def parse_key_file(path: Path) -> tuple[tuple[str, Role], ...]:
    """``(key, role)`` pairs of an ``--api-key-file``. ``ConfigError`` names the file and line of a bad entry
    (never the key itself)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None
    pairs: list[tuple[str, Role]] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        role, sep, key = entry.partition(":")
        role, key = role.strip(), key.strip()
        where = f"--api-key-file {path}, line {number}"
        if not sep or role not in ROLES:
            raise ConfigError(f"{where}: expected ROLE:KEY with ROLE one of {', '.join(ROLES)}")
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"{where}: the key is empty or contains whitespace")
        if key in seen:
            raise ConfigError(f"{where}: this key is already listed on an earlier line")
        seen.add(key)
        pairs.append((key, role))  # type: ignore[arg-type]  # role is checked against ROLES above
    return tuple(pairs)


@dataclass(frozen=True)
class KeyRing:
    """The configured keys. Empty: authentication is off."""

    keys: tuple[tuple[str, Role], ...] = field(default=(), repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        pairs: list[tuple[str, Role]] = []
        if settings.api_key_file is not None:
            pairs.extend(parse_key_file(settings.api_key_file))
        pairs.extend((key, "admin") for key in settings.api_keys if key)
        return cls(tuple(pairs))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def role_of(self, given: str) -> Role | None:
        """The strongest role of ``given`` (every key is compared, each in constant time)."""
        found: Role | None = None
        raw = given.encode("utf-8")
        for key, role in self.keys:
            if hmac.compare_digest(raw, key.encode("utf-8")) and found != "admin":
                found = role
        return found

    def authorize(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raise ``Unauthenticated`` (no or unknown key) or ``PermissionDenied`` (a generate key on an admin RPC)."""
        needed = required_role(method)
        if not self.enabled or needed is None:
            return
        role = self.role_of(_bearer(metadata))
        if role is None:
            raise Unauthenticated("missing or unknown API key: send `authorization: Bearer <key>` metadata")
        if needed == "admin" and role != "admin":
            raise PermissionDenied(f"{service_of(method)} needs an admin API key; this key has the generate role")


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key of an ``authorization: Bearer <key>`` entry ("" if none). The scheme is matched ignoring case
    (RFC 7235: ``bearer`` and ``BEARER`` are the same scheme), and separated from the key by whitespace."""
    for key, value in metadata or ():
        if key.lower() != "authorization" or not isinstance(value, str):
            continue
        parts = value.split(maxsplit=1)
        if len(parts) == 2 and parts[0].lower() == "bearer":
            return parts[1].strip()
    return ""
