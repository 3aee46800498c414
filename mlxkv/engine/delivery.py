"""Handing events from the engine thread to asyncio event loops: one loop wake-up per burst, not per event.

Each ``loop.call_soon_threadsafe`` writes to the loop's self-pipe and costs the loop a wake-up, and every
wake-up makes the loop thread take the GIL back from the engine thread (up to a switch interval each time).
A decode step emits one event per running sequence, so a :class:`LoopDelivery` queues events and keeps at
most one drain scheduled; inside :func:`batched_wakeups` (the engine wraps each step in it) no loop is woken
until the block ends, then each loop once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

Deliver = Callable[[Any], None]  # runs on the loop: hands one event to its consumer
OnClosed = Callable[[], None]  # runs on the caller's thread: the loop is gone, the consumer never reads again


class LoopDelivery:
    """Events from any thread into one event loop, delivered in order, with at most one drain scheduled.

    Attributes:
        wakeups: drains scheduled on the loop so far (one per burst of events).
        delivered: events handed to their consumers so far.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: the registry below is keyed weakly by the loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Deliver, OnClosed, Any]] = []  # guarded by _lock
        self._scheduled = False  # a drain is scheduled and has not taken the pending events yet (by _lock)
        self.wakeups = 0
        self.delivered = 0

    def put(self, deliver: Deliver, on_closed: OnClosed, event: Any) -> None:
        """Queue ``deliver(event)`` to run on the loop; wake the loop unless a drain is already scheduled or
        the calling thread is inside :func:`batched_wakeups`. If the loop has closed, ``on_closed()`` runs
        (on this thread) for every event still queued."""
        with self._lock:
            self._pending.append((deliver, on_closed, event))
        held = getattr(_held, "deliveries", None)
        if held is not None:
            held[id(self)] = self
        else:
            self.wake()

    def wake(self) -> None:
        """Schedule a drain if events are pending and none is scheduled."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
            self.wakeups += 1
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will ever read these
            with self._lock:
                dropped, self._pending, self._scheduled = self._pending, [], False
            for _, closed, _ in dropped:
                closed()

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for deliver, _, event in batch:
            deliver(event)
        self.delivered += len(batch)


_held = threading.local()  # .deliveries: {id: LoopDelivery} put to inside the current batched_wakeups block


@contextlib.contextmanager
def batched_wakeups() -> Iterator[None]:
    """Within this block, events put on this thread queue up; each loop that got some is woken once at the end."""
    if getattr(_held, "deliveries", None) is not None:  # nested: the outer block wakes
        yield
        return
    _held.deliveries = {}
    try:
        yield
    finally:
        deliveries, _held.deliveries = _held.deliveries, None
        for delivery in deliveries.values():
            delivery.wake()


def flush_wakeups() -> None:
    """Inside a :func:`batched_wakeups` block: wake now each loop that got events so far (first tokens sampled
    by a prefill reach their clients before the step's decode runs); the block goes on holding later events."""
    deliveries = getattr(_held, "deliveries", None)
    if deliveries:
        _held.deliveries = {}
        for delivery in deliveries.values():
            delivery.wake()


_deliveries: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery]" = weakref.WeakKeyDictionary()
_deliveries_lock = threading.Lock()


def delivery_for(loop: asyncio.AbstractEventLoop) -> LoopDelivery:
    """The :class:`LoopDelivery` of ``loop``, shared by every request whose events go to that loop."""
    with _deliveries_lock:
        delivery = _deliveries.get(loop)
        if delivery is None:
            delivery = _deliveries[loop] = LoopDelivery(loop)
        return delivery
