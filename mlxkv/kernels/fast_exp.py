"""``2 ** x`` for softmax exponents (``x <= 0``) on MLX's CPU backend: a compiled polynomial, checked at first use.

The exponentials of attention's softmax dominate attention over long contexts on the CPU: ``mx.exp`` takes
~16-26 ns per float32 element there and ``mx.power(2, x)`` ~6-10 ns. Split ``x = n + f`` (``n`` the nearest
integer, ``f`` in ``[-0.5, 0.5]``): ``2 ** f`` is a degree-6 polynomial (Taylor, relative error ~1e-7) and
``2 ** n`` is built in the float's exponent bits. ``mx.compile(shapeless=True)`` fuses the graph into C++ kernels
(MLX builds them with the system compiler once per machine and caches them on disk; MLX 0.32 splits this graph
into seven, seen with ``mx.export_to_dot``): 2-6 ns per element measured here against ``mx.power``'s 6-12 on the
same inputs (5.5 against 6.5-7.5 in a slow patch of this VM, whose speed varies over minutes); the bit cast and the
product run after it, outside the compiled function.

Used only on the CPU device, for float32 inputs of ``MIN_ELEMENTS`` to ``MAX_ELEMENTS`` elements (a compiled call
costs ~0.1-0.2 ms, below that ``mx.power`` is as fast; above it the compiled kernel slows down), and only after a
self-check against ``mx.power`` passed in this process (no compiler, ``MLX_DISABLE_COMPILE``, or any mismatch:
``mx.power``, with one warning).
Exponents below -125 give exactly 0 (``mx.power``: below 2**-125, i.e. nothing a softmax sum can see).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading

import mlx.core as mx

log = logging.getLogger(__name__)

#: Smaller inputs take ``mx.power`` (a compiled call's fixed cost is about that of ``mx.power`` on 8K elements).
MIN_ELEMENTS = 8192
#: Larger inputs take ``mx.power`` too: measured here, the compiled kernel falls off a cliff past ~400-800K elements
#: (5-6 -> ~30 ns per element, while ``mx.power`` stays at 6-10), so it is used up to 384K elements (e.g. 16 query
#: rows x 2 kv heads over 12K keys, or a 48-row prefill chunk with 2 kv heads over 4K).
MAX_ELEMENTS = 393216
#: Self-check bound: ``|fast - power| <= RELATIVE * power + ABSOLUTE``.
RELATIVE, ABSOLUTE = 1e-6, 1e-37
#: ``2 ** 23 * 1.5``: adding and subtracting it rounds a float32 of magnitude < 2 ** 22 to the nearest integer.
_ROUND = 12582912.0
#: Taylor coefficients of ``2 ** f = exp(f ln 2)``: ``ln(2) ** k / k!`` for k = 6 .. 1.
_COEFFS = (1.5403530393381606e-4, 1.3333558146428443e-3, 9.6181291076284772e-3, 5.5504108664821580e-2,
           2.4022650695910071e-1, 6.9314718055994531e-1)


def _parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """``2 ** x`` as (mantissa factor ``2 ** f`` float32, exponent bits of ``2 ** n`` int32), element-wise."""
    clamped = mx.maximum(x, -125.0)
    n = (clamped + _ROUND) - _ROUND  # nearest integer (IEEE round-to-nearest)
    f = clamped - n  # [-0.5, 0.5]
    p = _COEFFS[0]
    for c in _COEFFS[1:]:
        p = p * f + c
    p = p * f + 1.0
    p = mx.where(x < -125.0, 0.0, p)  # exact 0 far below the max (and for -inf); NaN stays NaN
    return p, (n.astype(mx.int32) + 127) << 23


_compiled_parts = mx.compile(_parts, shapeless=True)
_lock = threading.Lock()
_ready: bool | None = None  # None: not checked yet in this process


def _exp2_compiled(x: mx.array) -> mx.array:
    p, bits = _compiled_parts(x)
    return p * bits.view(mx.float32)


def _self_check() -> bool:
    """Whether the compiled path builds, runs and matches ``mx.power`` on exponents from 0 to -inf."""
    if os.environ.get("MLX_DISABLE_COMPILE") or (sys.platform.startswith("linux") and shutil.which("g++") is None):
        return False  # uncompiled (MLX builds CPU kernels with g++ on Linux), its passes are slower than mx.power
    grid = mx.concatenate([
        -mx.arange(0, 130, 0.0625, dtype=mx.float32),  # every sixteenth, through the clamp
        -mx.random.uniform(0, 40, (MIN_ELEMENTS,), key=mx.random.key(0)),
        mx.array([-0.5, -1e-9, -124.99, -125.0, -125.01, -1e4, -mx.inf], dtype=mx.float32),
    ])
    try:
        got = _exp2_compiled(grid)
        want = mx.power(2.0, grid)
        ok = bool(mx.all(mx.abs(got - want) <= RELATIVE * want + ABSOLUTE).item())
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: anything means "use mx.power"
        log.warning("the compiled exponential failed to build or run (%s): attention uses mx.power", exc)
        return False
    if not ok:
        log.warning("the compiled exponential disagrees with mx.power: attention uses mx.power")
    return ok


def fast_exp2_ready() -> bool:
    """Whether :func:`exp2` takes the compiled path on this device (runs the self-check once per process; the
    first call on a machine may take seconds while MLX builds the kernel)."""
    global _ready
    if mx.default_device().type != mx.cpu:
        return False
    if _ready is None:
        with _lock:
            if _ready is None:
                _ready = _self_check()
    return _ready


def exp2(x: mx.array) -> mx.array:
    """``2 ** x`` for ``x <= 0`` (softmax exponents): the compiled polynomial where it applies, else ``mx.power``."""
    if x.dtype == mx.float32 and MIN_ELEMENTS <= x.size <= MAX_ELEMENTS and fast_exp2_ready():
        return _exp2_compiled(x)
    return mx.power(2.0, x)
