"""DirectEngine: token-exact greedy decoding vs mlx-lm, stopping rules, sequences always released."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from testkit.archs import ARCHITECTURES, build_model

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.store import CachePool
from mlxkv.models import load

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # 45 tokens: past gemma3's window, across llama4 chunks
NEW_TOKENS = 24


def mlx_lm_greedy(model, prompt, n):
    """mlx-lm's own greedy generation loop over mlx-lm's own caches (the reference)."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [token for token, _ in steps]


@pytest.mark.parametrize("layout", ["mlxkv", "mlx-lm"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_tokens_equal_mlx_lm(arch, layout):
    model, _ = build_model(arch)
    expected = mlx_lm_greedy(model, PROMPT, NEW_TOKENS)
    engine = DirectEngine(model, tokenizer=None, pool=CachePool(model, layout=layout))
    got = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    assert got == expected
    assert len(set(got)) > 1, "degenerate test model: every token is the same"
    assert len(engine.pool) == 0


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def test_sequence_is_released_when_the_consumer_stops_early(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=50))
    next(stream)
    assert len(engine.pool) == 1
    stream.close()
    assert len(engine.pool) == 0
    assert engine.pool.memory_usage_bytes() == 0


def test_length_finish_and_stats(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    chunks = list(engine.generate(PROMPT, SamplingParams(max_tokens=7)))
    assert [c.finish_reason for c in chunks] == [None] * 6 + ["length"]
    stats = engine.last_stats
    assert stats.prompt_tokens == len(PROMPT) and stats.generation_tokens == 7
    assert stats.kv_bytes > 0 and stats.peak_memory_bytes > 0


def test_eos_token_ends_generation(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    greedy = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=12)))
    llama.tokenizer.eos_token_ids = {greedy[4]}  # pretend the 5th greedy token is EOS
    try:
        chunks = list(engine.generate(PROMPT, SamplingParams(max_tokens=12)))
    finally:
        llama.tokenizer.eos_token_ids = {2}
    first = greedy.index(greedy[4])
    assert len(chunks) == first + 1 and chunks[-1].finish_reason == "stop"


def test_stop_string_ends_generation_without_emitting_it(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    full = "".join(c.text for c in engine.generate(PROMPT, SamplingParams(max_tokens=20)))
    stop = full.strip()[5:9]
    assert stop.strip(), "need a non-blank stop string"
    chunks = list(engine.generate(PROMPT, SamplingParams(max_tokens=20, stop=(stop,))))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert stop not in text and full.startswith(text) and len(text) == full.index(stop)


def test_seeded_sampling_is_reproducible(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    params = SamplingParams(max_tokens=10, temp=1.0, seed=123)
    first = list(engine.generate_tokens(PROMPT, params))
    assert list(engine.generate_tokens(PROMPT, params)) == first


def test_empty_prompt_is_rejected(llama):
    engine = DirectEngine(llama.model, llama.tokenizer)
    with pytest.raises(ValueError, match="empty"):
        list(engine.generate_tokens([], SamplingParams()))
    assert len(engine.pool) == 0
