"""Absorbed MLA end to end: MLXKV_MLA_ABSORBED=1 through the pool and engine gives the same greedy tokens,
with latent caches that hold fewer bytes."""

import pytest

from mlxkv.env import reload as reload_flags
from testkit.deepseek import build_deepseek

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.store import CachePool
from mlxkv.mla import LatentCache, apply_mla

PROMPT = [(13 * i + 7) % 900 + 10 for i in range(40)]


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_flag_runs_the_engine_on_latent_caches_with_equal_tokens(monkeypatch, arch):
    model, _ = build_deepseek(arch, seed=0)
    params = SamplingParams(max_tokens=16)
    plain_pool = CachePool(model)
    plain = DirectEngine(model, None, pool=plain_pool)
    expected = list(plain.generate_tokens(PROMPT, params))
    monkeypatch.setenv("MLXKV_MLA_ABSORBED", "1")
    reload_flags()
    assert apply_mla(model)  # the loader's call: layers swapped
    pool = CachePool(model)
    seq = pool.open()
    assert all(isinstance(c, LatentCache) for c in seq.caches)
    pool.release(seq.id)
    absorbed = DirectEngine(model, None, pool=pool)
    assert list(absorbed.generate_tokens(PROMPT, params)) == expected
    if arch == "deepseek_v2":  # mlx-lm caches expanded per-head K/V for V2 ...
        assert 0 < absorbed.last_stats.kv_bytes < plain.last_stats.kv_bytes / 2
    else:  # ... and already the latent + rope key for V3 (it re-expands them for multi-token steps)
        assert absorbed.last_stats.kv_bytes == plain.last_stats.kv_bytes
    with pytest.raises(ValueError, match="absorbed MLA"):
        CachePool(model, max_kv_size=64).open()
