"""Which version a request goes to, beyond the candidate's share: sticky sessions and a
tester's header. Pure functions over the router's request dict, the same in every replica.

- A request carrying a session key (`X-Session-Id`; for a policy also `episode_id` in its
  JSON body) is drawn by a stable hash of the key (BLAKE2b, not Python's per-process
  `hash()`), salted with the candidate's version: a session stays on one version while the
  share holds, moves only when the share grows, and a new rollout draws afresh.
- `X-Canary: always|never` sends a tester's request to the candidate (or keeps it off it)
  while a rollout holds the route, when the route lets testers (`Testers`); otherwise the
  header is ignored.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal

from prefect_ray_lifecycle.workloads.constants import (
    CANARY_HEADER,
    CANARY_TOKEN_HEADER,
    SESSION_HEADER,
)
from prefect_ray_lifecycle.workloads.http import BadRequest, describe, peek_field

__all__ = [
    "MAX_SESSION_KEY",
    "TESTER_CHOICES",
    "check_episode_id",
    "episode_key",
    "session_key",
    "sticky_draw",
    "canary_choice",
    "token_digest",
]

MAX_SESSION_KEY = 256  # characters
TESTER_CHOICES = ("always", "never")
TesterChoice = Literal["always", "never"]


def session_key(req: dict[str, Any]) -> str | None:
    """The request's X-Session-Id as a session key, None without one; a 400 for one longer
    than MAX_SESSION_KEY characters (checked on every request, whatever the rollout)."""
    given = (req.get("headers") or {}).get(SESSION_HEADER.lower())
    if not given:
        return None
    if len(given) > MAX_SESSION_KEY:
        raise BadRequest(
            400,
            f"{SESSION_HEADER} must be at most {MAX_SESSION_KEY} characters, got {len(given)}",
            SESSION_HEADER,
        )
    return f"session:{given}"


def episode_key(body: bytes) -> str | None:
    """A policy request's `episode_id` as a session key, when it is a usable one (a string of
    1 to MAX_SESSION_KEY characters, or an integer); None otherwise: the policy answers a bad
    one with its 422."""
    value = peek_field(body, "episode_id")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return f"episode:{value}"
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_KEY:
        return f"episode:{value}"
    return None


def check_episode_id(payload: dict[str, Any]) -> None:
    """A policy request's `episode_id`, when given, is a string of 1 to MAX_SESSION_KEY
    characters or an integer: a 422 naming it otherwise."""
    if "episode_id" not in payload:
        return
    value = payload["episode_id"]
    if isinstance(value, int) and not isinstance(value, bool):
        return
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_KEY:
        return
    raise BadRequest(
        422,
        f"episode_id must be a string of 1 to {MAX_SESSION_KEY} characters or an integer; "
        f"got {describe(value)}",
        "episode_id",
    )


def sticky_draw(salt: str, key: str) -> float:
    """A session's place in [0, 1): below the candidate's share, it is the candidate's."""
    data = f"{salt}\0{key}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def token_digest(token: str) -> str:
    """What a route keeps of a tester's token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def canary_choice(
    req: dict[str, Any], mode: str, token_sha256: str | None = None
) -> TesterChoice | None:
    """A tester's `X-Canary` choice when the route honours it (its testers' `mode`: off, on,
    or token: with an X-Canary-Token whose SHA-256 is `token_sha256`), else None (ignored:
    testers off, or the token missing or wrong). A 400 for a value other than always or never
    where testers are let in."""
    if mode == "off":
        return None
    headers = req.get("headers") or {}
    value = headers.get(CANARY_HEADER.lower())
    if value is None:
        return None
    if mode == "token":
        token = headers.get(CANARY_TOKEN_HEADER.lower(), "")
        if not token or not hmac.compare_digest(token_digest(token), token_sha256 or ""):
            return None
    choice = value.strip().lower()
    if choice not in TESTER_CHOICES:
        raise BadRequest(
            400,
            f"{CANARY_HEADER} must be one of {', '.join(TESTER_CHOICES)}, got {describe(value)}",
            CANARY_HEADER,
        )
    return choice  # type: ignore[return-value]
