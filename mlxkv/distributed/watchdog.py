"""A rank that stops answering ends this process with a clear error instead of hanging it.

Every collective of the plan channel (:mod:`mlxkv.distributed.channel`) completes at least every heartbeat
interval while the ranks are healthy: the leader sends a plan before each forward and a no-op when idle. The
watchdog thread ends the process when none has completed for ``timeout_s``; a lost TCP peer is reported sooner by
MLX itself (``RuntimeError: [ring] connection to a peer was lost``), which :func:`fatal` turns into the same exit.
"""

from __future__ import annotations

import os
import sys
import threading
import time

#: Exit status of a rank stopped because another rank failed or stopped answering.
EXIT_PEER_LOST = 75


def fatal(rank: int, message: str) -> None:
    """Print why this rank stops and end the process at once (no cleanup could reach the lost rank anyway;
    ``mlx.launch`` then stops the other ranks)."""
    sys.stderr.write(f"mlxkv: rank {rank}: {message}: stopping\n")
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)


class Watchdog:
    """Ends the process when :meth:`beat` was not called for ``timeout_s`` seconds.

    Args:
        rank: this rank (for the message).
        timeout_s: longest silence allowed; also bounds one forward (make it longer than the slowest step).
    """

    def __init__(self, rank: int, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"the distributed timeout must be > 0 seconds, got {timeout_s}")
        self.rank = rank
        self.timeout_s = timeout_s
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mlxkv-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        """A collective completed: the other ranks are alive."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self.timeout_s / 4)):
            silent = time.monotonic() - self._last
            if silent > self.timeout_s:
                fatal(self.rank, f"no answer from the other ranks for {silent:.0f} s (--distributed-timeout "
                                 f"{self.timeout_s:g}): a rank failed or is stuck")
