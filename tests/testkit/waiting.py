"""Waiting for a condition another thread or process brings about."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.02) -> None:
    """Call ``predicate`` every ``interval`` seconds until it is true; fail (AssertionError) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {predicate}"
        time.sleep(interval)
