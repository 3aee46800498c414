"""Memory: standard caches grow with context, rotating and chunked ones stop at their window (plus the
documented slack); a single-token decode write lands in place, so per-step cost and peak memory do not
depend on the buffer's capacity."""

import time

import mlx.core as mx
import pytest
from testkit.archs import build_model

from mlxkv.kv.layouts import (
    ChunkedKVCache,
    KVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    install_attention_hook,
)

N_KV, D = 2, 16
ROW = 2 * N_KV * D * 4  # bytes per token: K and V, float32


def feed(cache, n, chunk=1, seed=0, d=D):
    kv = mx.random.normal((1, N_KV, n, d), key=mx.random.key(seed))  # (B, n_kv, L, D)
    sizes = []
    for i in range(0, n, chunk):
        mx.eval(cache.update_and_fetch(kv[..., i:i + chunk, :], kv[..., i:i + chunk, :]))
        sizes.append(cache.nbytes)
    return sizes


def test_standard_grows_with_context():
    cache = KVCache(step=256)
    feed(cache, 100)
    assert cache.nbytes == 256 * ROW
    feed(cache, 500)
    assert cache.nbytes == 768 * ROW  # 600 tokens, grown 256 rows at a time


@pytest.mark.parametrize("chunk", [1, 7])
def test_rotating_stops_at_window_plus_undo_record(chunk):
    cache = RotatingKVCache(64, keep=4, max_rewind=32, step=48)
    sizes = feed(cache, 2000, chunk)
    assert max(sizes) == sizes[-1] == (64 + 32) * ROW  # max_size + max_rewind rows, then flat
    assert sizes.index(max(sizes)) * chunk < 100  # reached within the first ring's worth of tokens


def test_quantized_rotating_stops_too():
    cache = QuantizedRotatingKVCache(64, max_rewind=32, step=48, bits=8, group_size=32)
    sizes = feed(cache, 1000, d=32)
    assert sizes[-1] == max(sizes) == sizes[200]


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_stops_at_chunk_plus_slack(chunk):
    c, rewind, step = 64, 32, 32
    cache = ChunkedKVCache(c, max_rewind=rewind, step=step)
    sizes = feed(cache, 3000, chunk)
    bound = (c + rewind + chunk + 2 * step) * ROW  # documented: chunk + max_rewind (+ the write) + 2 steps
    assert max(sizes) <= bound
    assert max(sizes[len(sizes) // 2:]) == max(sizes[len(sizes) // 4:])  # flat after the start


# -- in-place decode writes -----------------------------------------------------------------------------

SMALL, BIG = 256, 1 << 18  # capacity in rows; a BIG buffer is 32 MiB per K or V per layer here


class HoldingKVCache(KVCache):
    """Negative control: keeps fetched views alive across the next write (what in-place writes forbid).
    With pipelined evaluation the next write runs after the next fetch, so hold the last two."""

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        self.held = [*getattr(self, "held", [])[-1:], out]
        return out


def decode_profile(model, caches, steps=16):
    """Pipelined greedy decode in the documented order (build step n+1 while step n runs, wait for step n,
    then schedule n+1: MLX decides donation when a write is scheduled); returns (seconds per step, peak
    bytes above the start)."""
    y = mx.argmax(model(mx.array([[5, 6, 7, 8]]), cache=caches)[:, -1], axis=-1)
    mx.eval(y)  # the buffers exist from here on
    mx.reset_peak_memory()
    start_mem = mx.get_active_memory()
    for _ in range(2):  # warm up
        y = mx.argmax(model(y[:, None], cache=caches)[:, -1], axis=-1)
        mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(model(y[:, None], cache=caches)[:, -1], axis=-1)
        y.item()
        mx.async_eval(nxt)
        y = nxt
    y.item()
    return (time.perf_counter() - t0) / steps, mx.get_peak_memory() - start_mem


@pytest.fixture(scope="module")
def llama():
    model, _ = build_model("llama")
    install_attention_hook(model)
    return model


def test_decode_write_is_in_place(llama):
    buffer_bytes = BIG * N_KV * D * 4
    times = {SMALL: [], BIG: []}
    for _ in range(2):  # alternate, keep the best of each (the machine is shared)
        for cap in (SMALL, BIG):
            t, peak = decode_profile(llama, [KVCache(step=cap) for _ in llama.layers])
            times[cap].append(t)
            # a copy of any one buffer would raise the peak by a whole buffer (32 MiB); in place it stays flat
            assert peak < buffer_bytes / 4, (cap, peak)
    # copying 4 x 32 MiB per step would make the big buffers >10x slower here; in place they are not
    assert min(times[BIG]) < 5 * min(times[SMALL]), times


def test_the_measurement_sees_copies(llama):
    """Holding views across the next write forces MLX to copy the buffers: peak memory and time show it."""
    buffer_bytes = BIG * N_KV * D * 4
    fine_t, _ = decode_profile(llama, [KVCache(step=BIG) for _ in llama.layers], steps=4)
    held_t, peak = decode_profile(llama, [HoldingKVCache(step=BIG) for _ in llama.layers], steps=4)
    assert peak >= 4 * buffer_bytes  # a copy of each K and V buffer of both layers kept alive
    assert held_t > 3 * fine_t


@pytest.mark.parametrize("layout", ["rotating", "chunked"])
def test_ring_and_chunk_writes_are_in_place(layout):
    """Rotating: a ring of 2^18 undo rows; chunked: a 2^18-row chunk. Decode rows land in place (the rotating
    window is gathered, never the ring)."""
    make = {"rotating": lambda: RotatingKVCache(16, max_rewind=BIG, step=BIG),
            "chunked": lambda: ChunkedKVCache(BIG, step=BIG)}[layout]
    cache = make()
    kv = mx.random.normal((1, N_KV, 64, D), key=mx.random.key(1))
    mx.eval(cache.update_and_fetch(kv[..., :40, :], kv[..., :40, :]), cache.arrays())  # as prefill() does
    mx.reset_peak_memory()
    start_mem = mx.get_active_memory()
    prev = None
    for i in range(40, 64):
        k, v = cache.update_and_fetch(kv[..., i:i + 1, :], kv[..., i:i + 1, :])
        out = k.sum() + v.sum()  # what attention does with them
        del k, v
        if prev is not None:
            prev.item()  # step n done before step n+1 is scheduled
        mx.async_eval(out)
        prev = out
    prev.item()
    assert mx.get_peak_memory() - start_mem < BIG * N_KV * D * 4 / 4
