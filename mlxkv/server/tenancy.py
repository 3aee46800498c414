"""What a client may ask of the shared cache: the server's cap on the retention priority a request may set.

A request above the cap (``mlxkv serve --max-client-priority``) is refused with a 400 naming the cap, not
clamped: a client that asked for 100 and silently got 50 would believe its prefix safe from eviction.
"""

from __future__ import annotations

from typing import Any

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
