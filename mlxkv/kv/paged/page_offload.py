"""``--kv-overflow offload`` on paged storage: one sequence's offloaded pages in host memory, and their key proxy.

When the sequence passes its budget, the pages h2o's ranking would drop are copied here (every layer of the
group: exact K/V as NumPy arrays, off the MLX allocator) before the sequence's reference to their blocks is
dropped. Each page's keys also stay resident as an 8-bit ``mx.quantize`` copy (the dense offload tier's proxy,
:mod:`mlxkv.kv.overflow.offload`): per-row keys rather than one mean key per page, because a page's attention
share is usually carried by a few rows, and a mean key (by Jensen's inequality) underestimates exactly those.

Every attention call of a layer adds, per offloaded page, its estimated share of the current queries' attention:
the page's rows' probability under one softmax over the attended (kept) rows and every offloaded row, summed over
the page's rows, maximised over query heads, queries and layers (summed rather than its best row's: on SmolLM2
both restore at the per-step limit nearly every step, and the sum came closer to the full cache's logits, mean
|diff| 0.71 vs 0.79 in the setting of ``tests/test_kv_overflow_real.py``). After the step
(:meth:`~mlxkv.kv.paged.page_overflow.PageOverflow.evict`) a page whose share passed the threshold gets a new
block, its exact K/V written back, and rejoins its table entry (its tokens keep their positions: keys are paged
after RoPE).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxkv.kv.overflow.mass import masked_scores, with_sinks
from mlxkv.kv.overflow.offload import PROXY_BITS, _proxy_group


class PageHostStore:
    """Offloaded pages of one sequence and full-attention group (all its layers).

    Host arrays are never modified in place, so a fork shares them (:meth:`clone` copies the dicts only).
    """

    def __init__(self, layers: list[int], block_size: int):
        self.layers = list(layers)
        self.block_size = block_size
        self.pages: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # entry -> layer -> K, V (n_kv, bs, D)
        self._proxy: dict[int, dict[int, tuple]] = {}  # entry -> layer -> proxy planes, each (1, n_kv, bs, w)
        self._dtype = "float32"  # the pages' MLX dtype, by name
        self._order: list[int] = []  # offloaded entries in the order of this step's accumulators
        self._stacked: dict[int, tuple] = {}  # layer -> proxy planes of _order, each (1, n_kv, P * bs, w)
        self._share: mx.array | None = None  # (P,) this step's largest estimated share per offloaded page
        self._mass: mx.array | None = None  # (P,) this step's estimated mass per page (summed as PageOverflow's)

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory held (exact K/V)."""
        return sum(k.nbytes + v.nbytes for per in self.pages.values() for k, v in per.values())

    def clone(self) -> "PageHostStore":
        """A fork's store: its own dicts over the same (immutable) host arrays and proxies."""
        twin = PageHostStore(self.layers, self.block_size)
        twin.pages = {e: dict(per) for e, per in self.pages.items()}
        twin._proxy = {e: dict(per) for e, per in self._proxy.items()}
        twin._dtype = self._dtype
        return twin

    def clear(self) -> None:
        """Free every host page and proxy (the sequence ended, was released or preempted)."""
        self.pages, self._proxy = {}, {}
        self._reset()

    def _reset(self) -> None:
        self._order, self._stacked, self._share, self._mass = sorted(self.pages), {}, None, None

    # -- moving pages ---------------------------------------------------------------------------------
    def offload(self, storage, entries: list[int], blocks: list[int]) -> None:
        """Copy pages ``blocks`` (table ``entries``) of every layer of the group to host memory (evaluated here,
        before the blocks are released)."""
        for e in entries:
            self.pages[e], self._proxy[e] = {}, {}
        for layer in self.layers:
            kp, vp = storage.pages(layer)  # (n_kv, NB, bs, D)
            idx = mx.array(blocks, dtype=mx.int32)
            k, v = kp[:, idx], vp[:, idx]  # (n_kv, E, bs, D)
            group = _proxy_group(k.shape[-1])
            # one proxy per page (its own buffers: a page restored alone frees its share)
            pages = [k[None, :, j] for j in range(len(entries))]  # each (1, n_kv, bs, D)
            proxies = [(p.astype(mx.float16),) if group is None else tuple(mx.quantize(p, group_size=group,
                                                                                        bits=PROXY_BITS))
                       for p in pages]
            mx.eval(k, v, *[a for p in proxies for a in p])
            self._dtype = str(k.dtype).rpartition(".")[2]
            # float32 host copies: NumPy has no bfloat16; exact for float16/bfloat16, restored in their own dtype
            hk, hv = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))  # (n_kv, E, bs, D)
            for j, e in enumerate(entries):
                self.pages[e][layer] = (np.ascontiguousarray(hk[:, j]), np.ascontiguousarray(hv[:, j]))
                self._proxy[e][layer] = proxies[j]
        self._reset()

    def take(self, entry: int) -> dict[int, tuple[mx.array, mx.array]]:
        """Remove page ``entry``; per layer its exact K/V as ``(bs, n_kv, D)`` rows in the pages' dtype."""
        dtype = getattr(mx, self._dtype)
        per = self.pages.pop(entry)
        del self._proxy[entry]
        self._reset()
        return {layer: (mx.array(k.transpose(1, 0, 2)).astype(dtype), mx.array(v.transpose(1, 0, 2)).astype(dtype))
                for layer, (k, v) in per.items()}

    # -- estimates ------------------------------------------------------------------------------------
    def _planes(self, layer: int) -> tuple:
        if layer not in self._stacked:
            parts = [self._proxy[e][layer] for e in self._order]
            self._stacked[layer] = tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))
        return self._stacked[layer]  # each (1, n_kv, P * bs, w)

    def estimate(self, layer: int, queries: mx.array, keys: mx.array, scale: float, mask, sinks) -> None:
        """Add the estimated attention share of each offloaded page for ``queries (1, n_q, L, D)`` of ``layer``,
        whose attended rows are ``keys (1, n_kv, K, D)`` under ``mask`` (lazy)."""
        if not self.pages or layer not in self.layers:
            return
        planes = self._planes(layer)
        B, n_q, L, D = queries.shape
        n_kv = keys.shape[1]
        rep = n_q // n_kv
        q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, rep * L, D)  # (1, n_kv, rep * L, D)
        if len(planes) == 1:
            k = planes[0].astype(mx.float32)
        else:
            k = mx.dequantize(*planes, group_size=_proxy_group(D), bits=PROXY_BITS)  # (1, n_kv, M, D)
        proxy = (q @ k.swapaxes(-1, -2)).reshape(B, n_kv, rep, L, -1)  # (1, n_kv, rep, L, M)
        resident = with_sinks(masked_scores(queries, keys, scale, mask), sinks)  # (1, n_kv, rep, L, [1 +] K)
        lse = mx.logsumexp(mx.concatenate([resident, proxy], axis=-1), axis=-1, keepdims=True)
        probs = mx.exp(proxy - lse)  # (1, n_kv, rep, L, M): every offloaded row is older than the queries
        pages = probs.reshape(B, n_kv, rep, L, -1, self.block_size).sum(axis=-1)  # (1, n_kv, rep, L, P)
        share, mass = pages.max(axis=(0, 1, 2, 3)), pages.sum(axis=(0, 1, 2, 3))  # (P,)
        self._share = share if self._share is None else mx.maximum(self._share, share)
        self._mass = mass if self._mass is None else self._mass + mass

    def arrays(self) -> list[mx.array]:
        """This step's lazy estimates."""
        return [a for a in (self._share, self._mass) if a is not None]

    def picks(self, threshold: float, limit: int) -> list[tuple[int, float]]:
        """``(entry, estimated mass)`` of the offloaded pages whose share passed ``threshold`` this step, at most
        ``limit``, the largest shares first; resets the step's estimates."""
        if self._share is None:
            return []
        share, mass = np.array(self._share), np.array(self._mass)
        order = [i for i in np.argsort(-share, kind="stable") if share[i] > threshold][:limit]
        out = [(self._order[i], float(mass[i])) for i in order]
        self._share = self._mass = None
        return out
