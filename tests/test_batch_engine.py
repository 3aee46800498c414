"""BatchEngine: concurrent requests give DirectEngine's tokens exactly; sequences are always released."""

import threading

import mlx.core as mx
import pytest
from testkit.archs import build_model
from testkit.waiting import wait_for

from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.request import GenerationRequest, PromptTooLongError, QueueFullError
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv.layouts.attention_hook import install_attention_hook
from mlxkv.kv.store import CachePool
from mlxkv.models import load

pytestmark = pytest.mark.float_order

# Lengths straddle gemma3's 8-token window and llama4's 16-token chunks; the first is a single token.
PROMPTS = [[(7 * i + 11 * j) % 900 + 10 for i in range(n)] for j, n in enumerate((1, 6, 13, 29, 47))]
NEW = 16


def tokens_of(handle):
    events = list(handle)
    assert events[-1].kind == "done", events[-1]
    return [e.token for e in events if e.kind == "token"], events


def direct_tokens(model, prompt, params):
    engine = DirectEngine(model, tokenizer=None, pool=CachePool(model, max_sequences=1))
    return list(engine.generate_tokens(prompt, params))


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def make_engine(model, tokenizer=None, layout="mlxkv", context_length=4096, **config):
    config.setdefault("max_sequences", 4)
    cfg = EngineConfig(**config)
    pool = CachePool(model, max_sequences=cfg.max_sequences, layout=layout)
    return BatchEngine(model, tokenizer, config=cfg, pool=pool, context_length=context_length).start()


def quantizable_llama():
    """The test llama with head_dim 32, so K/V can be quantized in groups of 32 (the test models have 16)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes
    from testkit.archs import get_config

    config = get_config("llama")
    config.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(3)
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * (2.0 / v.shape[-1] ** 0.5) if v.ndim > 1 else v)
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("arch,pool_options,batched", [
    ("llama", {}, True),
    ("llama", {"layout": "mlx-lm"}, True),
    ("llama", {"max_kv_size": 24}, True),  # rotating with 4 sink tokens, past its window
    ("quantized", {"kv_bits": 4, "kv_group_size": 32, "max_kv_size": 24}, True),
    ("gemma3_text", {}, True),  # sliding window: per-sequence masks, some None and some arrays in one step
    ("qwen3_next", {}, True),  # recurrent state layer: stacked state view
    ("llama4", {}, False),  # reads chunk internals from cache[0]: the probe says decode one by one
])
def test_concurrent_greedy_equals_direct_engine(arch, pool_options, batched):
    model = quantizable_llama() if arch == "quantized" else build_model(arch)[0]
    install_attention_hook(model)
    params = SamplingParams(max_tokens=NEW)
    expected = [list(DirectEngine(model, None, pool=CachePool(model, max_sequences=1, **pool_options))
                     .generate_tokens(p, params)) for p in PROMPTS]
    # 5 requests over 4 slots with 8-token prefill chunks: admissions, chunked prefill and decode interleave.
    cfg = EngineConfig(max_sequences=4, prefill_chunk_size=8)
    engine = BatchEngine(model, None, config=cfg, pool=CachePool(model, max_sequences=4, **pool_options),
                         context_length=4096).start()
    try:
        handles = [engine.submit(GenerationRequest(p, params)) for p in PROMPTS]
        got = [tokens_of(h)[0] for h in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == expected
    assert all(len(set(t)) > 1 for t in got), "degenerate test model"
    assert stats["batched_decode"] is batched, stats["batched_decode_reason"]
    if batched:
        assert stats["batched_steps_total"] > 0 and stats["unbatched_steps_total"] == 0 and stats["max_batch"] == 4
    assert stats["pool_sequences"] == 0 and stats["running"] == 0 and stats["kv_bytes"] == 0


def test_text_stop_strings_and_usage_match_direct_engine(llama):
    direct = DirectEngine(llama.model, llama.tokenizer)
    prompt = llama.tokenizer.encode("The import statement")
    full = "".join(c.text for c in direct.generate(prompt, SamplingParams(max_tokens=24)))
    stop = full.strip()[6:10]
    params = SamplingParams(max_tokens=24, stop=(stop,))
    want = list(direct.generate(prompt, params))
    engine = make_engine(llama.model, llama.tokenizer)
    try:
        handles = [engine.submit(GenerationRequest(prompt, params)) for _ in range(3)]
        results = [tokens_of(h)[1] for h in handles]
    finally:
        engine.stop()
    for events in results:
        chunks = [e for e in events if e.kind == "token"]
        assert [(c.text, c.token, c.finish_reason) for c in chunks] == [(c.text, c.token, c.finish_reason)
                                                                        for c in want]
        assert chunks[-1].finish_reason == "stop" and stop not in "".join(c.text for c in chunks)
        assert events[-1].usage.prompt_tokens == len(prompt) and events[-1].usage.completion_tokens == len(chunks)


def test_seeded_sampling_equals_direct_engine_and_parallel_samples_fork(llama):
    prompt = PROMPTS[3]
    params = SamplingParams(max_tokens=12, temp=0.9, top_k=40, seed=7)
    engine = make_engine(llama.model, llama.tokenizer)
    try:
        _, events = tokens_of(engine.submit(GenerationRequest(prompt, params, n=3)))
        greedy_events = tokens_of(engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=12), n=2)))[1]
        stats = engine.stats()
    finally:
        engine.stop()
    per_choice = [[e.token for e in events if e.kind == "token" and e.index == i] for i in range(3)]
    for i, toks in enumerate(per_choice):  # choice i samples like a direct run seeded with seed + i
        p = SamplingParams(max_tokens=12, temp=0.9, top_k=40, seed=7 + i)
        assert toks == direct_tokens(llama.model, prompt, p)
    assert per_choice[0] != per_choice[1]
    greedy = direct_tokens(llama.model, prompt, SamplingParams(max_tokens=12))
    for i in range(2):
        assert [e.token for e in greedy_events if e.kind == "token" and e.index == i] == greedy
    assert events[-1].usage.completion_tokens == 36
    assert stats["pool_sequences"] == 0


def test_cancel_stops_and_releases_the_sequence(llama):
    engine = make_engine(llama.model, llama.tokenizer)
    try:
        handle = engine.submit(GenerationRequest(PROMPTS[2], SamplingParams(max_tokens=100000)))
        first = handle.get(timeout=20)
        assert first.kind == "token"
        wait_for(lambda: engine.stats()["running"] == 1)
        handle.cancel()
        events = list(handle)
        assert events[-1].kind == "error" and events[-1].finish_reason == "cancelled"
        wait_for(lambda: engine.stats()["pool_sequences"] == 0)
        stats = engine.stats()
    finally:
        engine.stop()
    assert stats["running"] == 0 and stats["kv_bytes"] == 0 and stats["cancelled_total"] == 1


def test_queue_full_prompt_too_long_and_context_cap(llama):
    engine = make_engine(llama.model, llama.tokenizer, context_length=64, max_sequences=1, max_queue_depth=1)
    try:
        with pytest.raises(PromptTooLongError, match="64 tokens"):
            engine.submit(GenerationRequest(list(range(10, 74)), SamplingParams(max_tokens=1)))
        with pytest.raises(ValueError, match="max_sequences"):
            engine.submit(GenerationRequest([5, 6], SamplingParams(max_tokens=1), n=2))
        # capped by the context: 60 prompt tokens leave room for 4
        capped = tokens_of(engine.submit(GenerationRequest(list(range(10, 70)), SamplingParams(max_tokens=50))))[1]
        assert [e.finish_reason for e in capped if e.kind == "token"] == [None, None, None, "length"]
        running = engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=60)))
        running.get(timeout=20)  # admitted and decoding: the queue is empty again
        waiting = engine.submit(GenerationRequest([5, 6], SamplingParams(max_tokens=2)))
        with pytest.raises(QueueFullError):
            engine.submit(GenerationRequest([5, 6], SamplingParams(max_tokens=2)))
        running.cancel()
        assert list(waiting)[-1].kind == "done"
        wait_for(lambda: engine.stats()["pool_sequences"] == 0)
    finally:
        engine.stop()


def test_priority_orders_admission(llama):
    engine = make_engine(llama.model, llama.tokenizer, max_sequences=1)
    done_order = []
    try:
        blocker = engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=60)))
        blocker.get(timeout=20)
        low = engine.submit(GenerationRequest([8, 9], SamplingParams(max_tokens=3), priority=5))
        high = engine.submit(GenerationRequest([8, 9], SamplingParams(max_tokens=3), priority=-1))
        threads = [threading.Thread(target=lambda h=h, name=name: (list(h), done_order.append(name)))
                   for h, name in ((low, "low"), (high, "high"))]
        for t in threads:
            t.start()
        wait_for(lambda: engine.stats()["waiting"] == 2)
        blocker.cancel()
        for t in threads:
            t.join(20)
    finally:
        engine.stop()
    assert done_order == ["high", "low"]


class FaultyModel:
    """Wraps a model; a prefill forward holding a prompt that starts with token 999 raises (batched with others or
    alone: the engine then prefills the batch's sequences one by one, and only that request fails)."""

    def __init__(self, model):
        self.model = model
        self.layers = model.layers

    def __call__(self, inputs, cache=None):
        if inputs.shape[1] > 1 and (inputs[:, 0] == 999).any().item():
            raise RuntimeError("injected fault")
        return self.model(inputs, cache=cache)

    def make_cache(self):
        return self.model.make_cache() if hasattr(self.model, "make_cache") else None


def test_an_exception_in_one_request_fails_only_that_request(llama):
    model = FaultyModel(llama.model)
    pool = CachePool(llama.model, max_sequences=4)
    engine = BatchEngine(model, llama.tokenizer, config=EngineConfig(max_sequences=4), pool=pool).start()
    try:
        good = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=8))) for p in PROMPTS[1:3]]
        bad = engine.submit(GenerationRequest([999, 5, 6, 7], SamplingParams(max_tokens=8)))
        bad_events = list(bad)
        good_tokens = [tokens_of(h)[0] for h in good]
        after = tokens_of(engine.submit(GenerationRequest(PROMPTS[3], SamplingParams(max_tokens=4))))[0]
        stats = engine.stats()
    finally:
        engine.stop()
    assert bad_events[-1].kind == "error" and "injected fault" in bad_events[-1].message
    assert good_tokens == [direct_tokens(llama.model, p, SamplingParams(max_tokens=8)) for p in PROMPTS[1:3]]
    assert len(after) == 4 and stats["failed_total"] == 1 and stats["pool_sequences"] == 0


def test_stop_ends_unfinished_requests_with_an_error(llama):
    engine = make_engine(llama.model, llama.tokenizer)
    handle = engine.submit(GenerationRequest(PROMPTS[2], SamplingParams(max_tokens=100000)))
    handle.get(timeout=20)
    engine.stop()
    assert list(handle)[-1].kind == "error"
    assert len(engine.pool) == 0
    mx.eval(mx.zeros(1))
