"""The --kv-overflow policies on the real model (SmolLM2-135M-Instruct, ``MLXKV_TEST_GGUF``, dequantized): exact
greedy tokens while the budget holds the context, and past it every layer stays within its budget."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.config import KvOverflowConfig
from mlxkv.kv import each_layer_cache, make_caches

GGUF_ENV = "MLXKV_TEST_GGUF"
GGUF = Path(os.environ.get(GGUF_ENV, "")).expanduser()
pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF_ENV} does not name the SmolLM2 GGUF file")
STEPS = 12


@pytest.fixture(scope="module")
def loaded():
    from mlxkv.models import load

    return load(str(GGUF), dequantize=True)


def greedy(model, caches, prompt, steps=STEPS):
    logits = model(mx.array(prompt)[None], cache=caches)[0, -1]
    out = []
    for _ in range(steps):
        out.append(mx.argmax(logits).item())
        logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
        mx.eval(logits)
    return out


@pytest.fixture(scope="module")
def prompt(loaded):
    return loaded.tokenizer.encode("The import statement combines two operations; it searches for the named "
                                   "module, then it binds the results of that search to a name in the local scope.")


@pytest.fixture(scope="module")
def plain(loaded, prompt):
    return greedy(loaded.model, make_caches(loaded.model), prompt)


@pytest.mark.parametrize("policy", ["h2o", "offload"])  # window is the rotating layout, tested on its own
def test_the_real_model_is_token_exact_under_a_budget_above_the_context(loaded, prompt, plain, policy):
    caches = make_caches(loaded.model, overflow=KvOverflowConfig(policy=policy, budget=256))
    assert greedy(loaded.model, caches, prompt) == plain


def test_the_real_model_stays_within_a_small_budget(loaded, prompt, plain):
    budget = 32
    caches = make_caches(loaded.model, overflow=KvOverflowConfig(policy="offload", budget=budget, recent=8))
    tokens = greedy(loaded.model, caches, prompt)
    layers = list(each_layer_cache(caches))
    assert all(c.evicted > 0 and c.size() <= budget + 1 + c.restore_limit for c in layers)
    assert all(c.size() + len(c.tier) == c.offset for c in layers)  # every token resident or on the host
    assert tokens[:4] == plain[:4]  # the first steps still see most of the prompt's mass


def test_paged_h2o_on_the_real_model(loaded, prompt, plain):
    """Paged storage (pages of 8): h2o is the plain cache under a large budget; under a small one whole pages go
    and the sequence keeps answering."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.kv import CachePool

    def run(overflow):
        pool = CachePool(loaded.model, backend="paged", num_blocks=64, overflow=overflow,
                         kv_config=KvCacheConfig(backend="paged", block_size=8))
        engine = DirectEngine(loaded.model, loaded.tokenizer, pool=pool)
        out = list(engine.generate_tokens(prompt, SamplingParams(max_tokens=STEPS, temp=0)))
        pool.check_invariants()
        return out, pool

    assert run(KvOverflowConfig(policy="h2o", budget=256))[0] == plain
    tokens, pool = run(KvOverflowConfig(policy="h2o", budget=32, recent=8))
    assert len(tokens) == STEPS and len(prompt) < 32 < len(prompt) + STEPS
    # the first eviction comes at 33 tokens: the 4 blocks full by then are cached, none written after it
    assert pool.paged.manager.pool.stats().cached == 4
