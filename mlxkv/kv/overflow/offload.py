"""The offload tier of one layer: evicted rows in host memory, with a cheap resident proxy of their keys.

Evicted K/V rows are copied into NumPy arrays (host memory, off the MLX allocator) together with their token
positions and accumulated mass. Their keys stay resident as an 8-bit ``mx.quantize`` copy (a quarter of the
float32 keys, no values): enough to estimate, for the current queries, how much attention each offloaded row
would get. Rows whose estimate passes the threshold are brought back with their exact K/V, positions and mass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxkv.kv.overflow.mass import with_sinks

PROXY_BITS = 8


def _proxy_group(head_dim: int) -> int | None:
    """The quantization group of the proxy keys (``None``: ``head_dim`` fits no group; keys kept as float16)."""
    return next((g for g in (64, 32) if head_dim % g == 0), None)


class OffloadTier:
    """Host-memory rows of one layer cache and their resident key proxy.

    Rows are kept in the order they were offloaded; ``take`` removes any subset.
    """

    def __init__(self) -> None:
        self.positions = np.zeros((0,), np.int64)  # (M,) token positions
        self._k: np.ndarray | None = None  # (B, n_kv, M, D) exact keys, host memory
        self._v: np.ndarray | None = None  # (B, n_kv, M, Dv) exact values
        self._mass: np.ndarray | None = None  # (n_kv, M) accumulated mass when offloaded
        self._proxy: tuple | None = None  # resident proxy planes, each (B, n_kv, M, w)
        self._dtype = "float32"  # the rows' MLX dtype, by name (an mx.Dtype does not deep-copy: pool.fork copies us)

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory held (exact rows, positions and mass)."""
        return sum(a.nbytes for a in (self._k, self._v, self._mass, self.positions) if a is not None)

    @property
    def proxy_nbytes(self) -> int:
        """Bytes of the resident key proxy."""
        return sum(p.nbytes for p in self._proxy) if self._proxy else 0

    def arrays(self) -> list[mx.array]:
        return list(self._proxy or ())

    def _encode(self, k: mx.array) -> tuple:
        group = _proxy_group(k.shape[-1])
        if group is None:
            return (k.astype(mx.float16),)
        return tuple(mx.quantize(k, group_size=group, bits=PROXY_BITS))

    def add(self, positions: mx.array, k: mx.array, v: mx.array, mass: mx.array) -> None:
        """Offload rows: ``positions (E,)``, ``k``/``v`` ``(B, n_kv, E, D)``, ``mass (n_kv, E)`` (evaluated here)."""
        proxy = self._encode(k)
        mx.eval(positions, k, v, mass, *proxy)
        self._dtype = str(k.dtype).rpartition(".")[2]
        # float32 host copies: NumPy has no bfloat16; the exact rows come back in their own dtype
        host = [np.array(x.astype(mx.float32)) for x in (k, v, mass)]
        self.positions = np.concatenate([self.positions, np.array(positions).astype(np.int64)])
        if self._k is None:
            self._k, self._v, self._mass = host
            self._proxy = proxy
            return
        self._k = np.concatenate([self._k, host[0]], axis=2)
        self._v = np.concatenate([self._v, host[1]], axis=2)
        self._mass = np.concatenate([self._mass, host[2]], axis=1)
        self._proxy = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self._proxy, proxy))

    def proxy_scores(self, queries: mx.array, scale: float) -> mx.array:
        """Estimated logits of ``queries (B, n_q, L, D)`` over the offloaded rows: ``(B, n_kv, rep, L, M)``."""
        B, n_q, L, D = queries.shape
        n_kv, M = self._proxy[0].shape[1], self._proxy[0].shape[2]
        rep = n_q // n_kv
        q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, rep * L, D)  # (B, n_kv, rep * L, D)
        if len(self._proxy) == 1:
            k = self._proxy[0].astype(mx.float32)  # (B, n_kv, M, D)
        elif mx.default_device() == mx.cpu:
            # MLX's CPU quantized matmul is many times slower than BLAS: a transient float copy of the proxy is cheaper
            k = mx.dequantize(*self._proxy, group_size=_proxy_group(D), bits=PROXY_BITS)  # (B, n_kv, M, D)
        else:
            s = mx.quantized_matmul(q, *self._proxy, transpose=True, group_size=_proxy_group(D), bits=PROXY_BITS)
            return s.reshape(B, n_kv, rep, L, M)
        return (q @ k.swapaxes(-1, -2)).reshape(B, n_kv, rep, L, M)  # (B, n_kv, rep, L, M)

    def select(self, queries: mx.array, resident_scores: mx.array, scale: float, sinks: mx.array | None,
               threshold: float, limit: int) -> np.ndarray:
        """Offloaded rows (indices into this tier) whose estimated attention share passes ``threshold``.

        The share is the row's probability under one softmax over the resident keys and every offloaded row (as
        if nothing had been evicted), maximised over query heads and queries; at most ``limit`` rows, the
        largest shares first.
        """
        proxy = self.proxy_scores(queries, scale)  # (B, n_kv, rep, L, M)
        joint = mx.concatenate([with_sinks(resident_scores, sinks), proxy], axis=-1)
        lse = mx.logsumexp(joint, axis=-1, keepdims=True)  # (B, n_kv, rep, L, 1)
        share = np.array(mx.exp(proxy - lse).max(axis=(0, 1, 2, 3)))  # (M,)
        picked = np.nonzero(share > threshold)[0]
        if picked.size > limit:
            picked = picked[np.argsort(-share[picked], kind="stable")[:limit]]
        return np.sort(picked)

    def take(self, rows: np.ndarray) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Remove ``rows`` (tier indices) and return them: ``positions (n,)``, ``k``/``v`` ``(B, n_kv, n, D)``,
        ``mass (n_kv, n)`` as MLX arrays."""
        dtype = getattr(mx, self._dtype)
        out = (mx.array(self.positions[rows].astype(np.int32)),
               mx.array(self._k[:, :, rows]).astype(dtype), mx.array(self._v[:, :, rows]).astype(dtype),
               mx.array(self._mass[:, rows]))
        stay = np.ones(len(self), bool)
        stay[rows] = False
        self.positions = self.positions[stay]
        if not stay.any():
            self.clear()
            return out
        self._k, self._v, self._mass = self._k[:, :, stay], self._v[:, :, stay], self._mass[:, stay]
        idx = mx.array(np.nonzero(stay)[0].astype(np.uint32))
        self._proxy = tuple(p[:, :, idx] for p in self._proxy)
        return out

    def clear(self) -> None:
        """Drop every offloaded row (host memory and proxy)."""
        self.positions = np.zeros((0,), np.int64)
        self._k = self._v = self._mass = None
        self._proxy = None
