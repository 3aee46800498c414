"""The --kv-overflow policies on the real model (SmolLM2-135M-Instruct, ``MLXKV_TEST_GGUF``, dequantized): exact
greedy tokens while the budget holds the context, and past it every layer stays within its budget."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.config import KvOverflowConfig
from mlxkv.kv import each_layer_cache, make_caches

pytestmark = [pytest.mark.real_model, pytest.mark.float_order]
STEPS = 12


def greedy(model, caches, prompt, steps=STEPS):
    logits = model(mx.array(prompt)[None], cache=caches)[0, -1]
    out = []
    for _ in range(steps):
        out.append(mx.argmax(logits).item())
        logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
        mx.eval(logits)
    return out


@pytest.fixture(scope="module")
def prompt(smollm2):
    return smollm2.tokenizer.encode("The import statement combines two operations; it searches for the named "
                                   "module, then it binds the results of that search to a name in the local scope.")


@pytest.fixture(scope="module")
def plain(smollm2, prompt):
    return greedy(smollm2.model, make_caches(smollm2.model), prompt)


@pytest.mark.parametrize("policy", ["h2o", "offload"])  # window is the rotating layout, tested on its own
def test_the_real_model_is_token_exact_under_a_budget_above_the_context(smollm2, prompt, plain, policy):
    caches = make_caches(smollm2.model, overflow=KvOverflowConfig(policy=policy, budget=256))
    assert greedy(smollm2.model, caches, prompt) == plain


def test_the_real_model_stays_within_a_small_budget(smollm2, prompt, plain):
    budget = 32
    caches = make_caches(smollm2.model, overflow=KvOverflowConfig(policy="offload", budget=budget, recent=8))
    tokens = greedy(smollm2.model, caches, prompt)
    layers = list(each_layer_cache(caches))
    assert all(c.evicted > 0 and c.size() <= budget + 1 + c.restore_limit for c in layers)
    assert all(c.size() + len(c.tier) == c.offset for c in layers)  # every token resident or on the host
    assert tokens[:4] == plain[:4]  # the first steps still see most of the prompt's mass


def test_paged_h2o_on_the_real_model(smollm2, prompt, plain):
    """Paged storage (pages of 8): h2o is the plain cache under a large budget; under a small one whole pages go
    and the sequence keeps answering."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.kv import CachePool

    def run(overflow):
        pool = CachePool(smollm2.model, backend="paged", num_blocks=64, overflow=overflow,
                         kv_config=KvCacheConfig(backend="paged", block_size=8))
        engine = DirectEngine(smollm2.model, smollm2.tokenizer, pool=pool)
        out = list(engine.generate_tokens(prompt, SamplingParams(max_tokens=STEPS, temp=0)))
        pool.check_invariants()
        return out, pool

    assert run(KvOverflowConfig(policy="h2o", budget=256))[0] == plain
    tokens, pool = run(KvOverflowConfig(policy="h2o", budget=32, recent=8))
    assert len(tokens) == STEPS and len(prompt) < 32 < len(prompt) + STEPS
    # the first eviction comes at 33 tokens: the 4 blocks full by then are cached, none written after it
    assert pool.paged.manager.pool.stats().cached == 4


def test_paged_offload_is_closer_to_the_full_cache_than_paged_h2o(smollm2):
    """Pages of 16 tokens, a budget of 64 under a 79-token prompt, 16 steps fed the full cache's greedy tokens:
    offload's logits are closer to the full cache's than h2o's (measured: mean |diff| 0.71 vs 0.81, max 5.2 vs
    5.6; OpenBLAS)."""
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.store import CachePool

    model = smollm2.model
    prompt = smollm2.tokenizer.encode(
        "The import statement combines two operations; it searches for the named module, then it binds the results "
        "of that search to a name in the local scope. The search operation of the import statement is defined as a "
        "call to the __import__() function, with the appropriate arguments. The return value of __import__() is used "
        "to perform the name binding operation of the import statement. Which operation comes first?")

    def run(overflow, tokens):
        pool = CachePool(model, backend="paged", num_blocks=32, max_sequences=1, overflow=overflow,
                         kv_config=KvCacheConfig(backend="paged", block_size=16))
        seq = pool.open(prompt=prompt)
        mx.eval(model(mx.array(prompt[:-1])[None], cache=seq.caches))
        seq.commit()
        logits = [model(mx.array(prompt[-1:])[None], cache=seq.caches)[0, -1]]
        seq.commit()
        for i in range(16):
            token = tokens[i] if tokens else int(mx.argmax(logits[-1]).item())
            seq.feed([token])
            logits.append(model(mx.array([[token]]), cache=seq.caches)[0, -1])
            mx.eval(logits[-1])
            seq.commit()
        state = next(iter(seq.paged.overflow.values()), None)
        pool.release(seq.id)
        assert pool.paged.overflow_host_bytes() == 0
        return mx.stack(logits), state

    full, _ = run(None, None)
    tokens = mx.argmax(full[:-1], axis=-1).tolist()
    errors = {}
    for policy in ("h2o", "offload"):
        logits, state = run(KvOverflowConfig(policy, budget=64, sinks=4, recent=16), tokens)
        assert state.evicted > 0
        diff = mx.abs(logits - full)
        errors[policy] = (diff.mean().item(), diff.max().item())
    assert state.restored > 0
    assert errors["offload"][0] < errors["h2o"][0] and errors["offload"][1] <= errors["h2o"][1], errors
