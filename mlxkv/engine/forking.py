"""Forking a sequence's caches for parallel samples (``n > 1``): prefill once, decode many.

For now a fork is a deep copy of every layer cache (MLX arrays are copied, so the copies never alias the
parent's buffers). A cache that knows how to share storage (a paged cache forking its block table with
copy-on-write) provides ``fork()``, which is used instead.
"""

from __future__ import annotations

import copy
from typing import Any


def fork_caches(caches: list[Any]) -> list[Any]:
    """Independent caches holding the same tokens as ``caches`` (one per layer)."""
    return [c.fork() if hasattr(c, "fork") else copy.deepcopy(c) for c in caches]
