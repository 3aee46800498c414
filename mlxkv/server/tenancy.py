"""What a client may ask of the shared cache: the retention priority it may set, and which blocks it may reset.

- A request above the retention-priority cap (``mlxkv serve --max-client-priority``) is refused with a 400
  naming the cap, not clamped: a client that asked for 100 and silently got 50 would believe its prefix safe.
- ``POST /v1/cache/reset`` with a ``cache_salt`` drops only the cached blocks of that tenant's prompts (knowing
  the salt is what makes one the tenant); without one it drops every tenant's, which a server started with
  ``--admin-key`` allows only to a caller presenting that key (403 otherwise).
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from mlxkv.server.auth import key_matches, request_key
from mlxkv.server.errors import APIError

MAX_PRIORITY = 100


def check_max_client_priority(cap: int) -> int:
    """``cap`` if it is a priority in 0..100.

    Raises:
        ValueError: out of range.
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_PRIORITY:
        raise ValueError(f"max_client_priority={cap!r}: expected an integer in 0..{MAX_PRIORITY}")
    return cap


def check_retention(retention: Any, cap: int) -> None:
    """Refuse a request's ``retention`` (schemas.RetentionBody or None) asking above ``cap``: only the priorities
    the request sets count (an unset ``decode_priority`` takes the server's default).

    Raises:
        APIError: 400 ``priority_above_cap`` naming the field and the cap.
    """
    if retention is None or cap >= MAX_PRIORITY:
        return
    asked = [(f"retention.token_ranges.{i}.priority", r.priority) for i, r in enumerate(retention.token_ranges)]
    if "decode_priority" in retention.model_fields_set:
        asked.append(("retention.decode_priority", retention.decode_priority))
    for field, priority in asked:
        if priority > cap:
            raise APIError(400, f"{field}: retention priority {priority} is above this server's cap of {cap} "
                                f"(--max-client-priority)", "priority_above_cap", field)


class CacheResetRequest(BaseModel):
    """``POST /v1/cache/reset`` body (optional): ``cache_salt`` limits the reset to that tenant's blocks."""

    model_config = ConfigDict(extra="forbid")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="reset only the blocks of prompts sent with this salt")


def reset_scope(body: CacheResetRequest | None, request: Request, admin_key: str | None) -> str | None:
    """The cache salt a reset is limited to, or None for every tenant — which, on a server with an admin key,
    only the admin key may ask for.

    Raises:
        APIError: 403 ``admin_key_required`` for a reset of every tenant without the admin key.
    """
    if body is not None and body.cache_salt is not None:
        return body.cache_salt
    if admin_key is not None and not key_matches(request_key(request), admin_key):
        raise APIError(403, "resetting every tenant's cache needs the admin key; send cache_salt to reset the "
                            "blocks of your own prompts", "admin_key_required", "cache_salt")
    return None
