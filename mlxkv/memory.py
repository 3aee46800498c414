"""Giving freed memory back to the system: MLX's buffer cache and, under glibc, the C heap's free pages.

MLX's CPU backend allocates with ``malloc``. Loading a model (a GGUF's quantized tensors decoded to float, a
half-precision folder upcast) frees hundreds of MB of transient buffers, which glibc keeps in its heap: the
process's resident memory stays at its peak although MLX reports the memory free. ``malloc_trim`` hands those
pages back. On macOS (Metal buffers, another allocator) clearing MLX's cache is what applies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

import mlx.core as mx


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_free_memory() -> None:
    """Return the memory MLX's buffer cache and the C heap hold unused to the system (resident memory drops)."""
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
