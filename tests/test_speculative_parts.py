"""Speculation's parts alone: prompt-lookup proposals, cache rewinding, greedy and sampled verification."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from mlxkv.engine.drafters import Draft, PromptLookupDrafter
from mlxkv.engine.rewind import CacheRewinder, RewindError, check_rewindable
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.verify import verify_greedy, verify_sampled
from mlxkv.kv.layouts import ChunkedKVCache, KVCache, RotatingKVCache

GREEDY = SamplingParams()


def lookup(history, k=4, ngram_size=3, min_ngram_size=1):
    drafter = PromptLookupDrafter(ngram_size, min_ngram_size)
    drafter.begin(history, GREEDY, vocab_size=100, max_draft=k)
    return drafter.propose(k).tokens


def test_lookup_continues_the_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7]
    assert lookup(hist) == [3, 4, 9, 5]  # (5, 6, 7) last seen at 5..7, followed by 3 4 9 5


def test_lookup_prefers_the_longest_ngram():
    hist = [1, 2, 3, 8, 8, 2, 3, 9, 9, 7, 1, 2, 3]
    assert lookup(hist, k=2) == [8, 8]  # 3-gram (1, 2, 3) beats the later 2-gram (2, 3) -> 9 9
    assert lookup(hist, k=2, ngram_size=2) == [9, 9]


def test_lookup_min_size_and_no_match():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([4, 1, 2, 3, 4], k=2) == [1, 2]  # 1-gram (4,)
    assert lookup([4, 1, 2, 3, 4], k=2, min_ngram_size=2) == []


def test_lookup_repeats_a_match_that_runs_into_the_present():
    assert lookup([7, 1, 2, 1, 2], k=5, ngram_size=2) == [1, 2, 1, 2, 1]
    assert lookup([3, 3, 3], k=4, ngram_size=2) == [3, 3, 3, 3]


def test_lookup_commit_extends_the_history():
    drafter = PromptLookupDrafter(ngram_size=2)
    drafter.begin([1, 2, 3, 4, 1, 2], GREEDY, vocab_size=100, max_draft=3)
    draft = drafter.propose(3)
    assert draft.tokens == [3, 4, 1]
    drafter.commit(draft, 1, 9)  # keeps 3, then the target's 9
    assert drafter.history == [1, 2, 3, 4, 1, 2, 3, 9]
    assert drafter.propose(3).tokens == []  # (3, 9) and (9,) never seen before
    drafter.commit(Draft([]), 0, 1)
    assert drafter.propose(2).tokens == [2, 3]


def filled(cache, n):
    kv = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)  # (B, heads, L, D)
    cache.update_and_fetch(kv, kv)
    return cache


def test_rewinder_refuses_mlx_lm_layouts_that_cannot_rewind():
    with pytest.raises(ValueError, match="RotatingKVCache"):
        check_rewindable([mlx_cache.KVCache(), mlx_cache.RotatingKVCache(8)])
    with pytest.raises(ValueError, match="ChunkedKVCache"):
        CacheRewinder([mlx_cache.CacheList(mlx_cache.ChunkedKVCache(16))])
    CacheRewinder([mlx_cache.KVCache(), RotatingKVCache(8), ChunkedKVCache(16)])  # ours are fine


def test_rewinder_needs_a_large_enough_undo_record():
    with pytest.raises(ValueError, match="max_rewind"):
        CacheRewinder([RotatingKVCache(8, max_rewind=2)], max_trim=5)
    CacheRewinder([RotatingKVCache(8, max_rewind=5)], max_trim=5)


def test_rewinder_trims_exactly_or_raises():
    caches = [filled(KVCache(), 10), filled(RotatingKVCache(4), 10)]
    CacheRewinder(caches).trim(3)
    assert [c.offset for c in caches] == [7, 7]

    class Stubborn(mlx_cache.KVCache):
        def trim(self, n):
            return super().trim(min(n, 1))

    with pytest.raises(RewindError, match="removed 1"):
        CacheRewinder([filled(Stubborn(), 5)]).trim(2)


def test_rewinder_snapshots_recurrent_state():
    state = mlx_cache.ArraysCache(2)
    state[0], state[1] = mx.zeros((1, 3)), mx.ones((1, 2))
    attn = filled(KVCache(), 6)
    rewinder = CacheRewinder([state, mlx_cache.CacheList(attn)])
    assert rewinder.needs_replay and rewinder.recurrent == [state] and rewinder.trimmable == [attn]
    snap = rewinder.snapshot()
    state[0] = mx.full((1, 3), 5.0)  # what a forward does: replace the state arrays
    filled(attn, 2)
    rewinder.trim(2)
    rewinder.restore(snap)
    assert mx.array_equal(state[0], mx.zeros((1, 3))) and attn.offset == 6
    state[1] = mx.zeros((1, 2))
    rewinder.restore(snap)  # a snapshot can be restored more than once
    assert mx.array_equal(state[1], mx.ones((1, 2)))
    assert CacheRewinder([attn]).snapshot() is None


def test_verify_greedy():
    logits = mx.array([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0]])  # argmaxes 1, 0, 2
    v = verify_greedy(logits, [1, 0])
    assert (v.accepted, v.token) == (2, 2)  # both accepted, bonus token from the last row
    v = verify_greedy(logits, [1, 2])
    assert (v.accepted, v.token) == (1, 0)  # second rejected: the target's own token replaces it
    v = verify_greedy(logits[:1], [])
    assert (v.accepted, v.token) == (0, 1)


def test_verify_sampled_edge_cases():
    mx.random.seed(0)
    p = mx.log(mx.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]]))
    for _ in range(50):
        # Point-mass draft of a token the target never samples: always rejected, never re-drawn.
        v = verify_sampled(p, [0, 1], None)
        assert v.accepted == 0 and v.token in (1, 2)
        # Draft distribution equal to the target's: always accepted, bonus from the last row.
        v = verify_sampled(p, [1, 2], p[:2])
        assert (v.accepted, v.token) == (2, 0)


def test_position_logprobs_apply_the_processors_over_the_history_extended_by_the_draft():
    """Verification position i of a penalised, biased row scores as a plain decode step would after emitting the
    draft's first i tokens: the same log-probabilities, the same greedy token; a history without the draft tokens
    would choose otherwise."""
    import mlx.core as mx
    import numpy as np

    from mlxkv.engine.row_sampler import RowSampler
    from mlxkv.engine.sampling import SamplingParams

    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.2,
                            logit_bias={5: 0.3}, repetition_context_size=6)
    prompt, draft = [1, 2, 3, 1], [7, 8, 7]
    logits = mx.array(np.random.default_rng(3).normal(size=(4, 12)).astype(np.float32) * 0.1)
    logits[:, 7] += 1.0  # 7 leads until it has been seen
    logits[:, 8] += 0.9
    scores = RowSampler(params, prompt=prompt).position_logprobs(logits, draft)  # (4, 12)
    stale = []
    for i in range(len(draft) + 1):
        seen, row = mx.array(prompt + draft[:i]), logits[i : i + 1]
        for process in params.processors():
            row = process(seen, row)
        assert np.allclose(scores[i].tolist(), (row - mx.logsumexp(row)).tolist()[0], atol=1e-6)
        fresh = RowSampler(params, prompt=prompt + draft[:i])  # plain decoding there
        assert fresh(logits[i : i + 1]).item() == int(mx.argmax(scores[i]).item())
        row = logits[i : i + 1]
        for process in params.processors():
            row = process(mx.array(prompt), row)
        stale.append(int(mx.argmax(row).item()))
    assert stale != mx.argmax(scores, axis=-1).tolist()
    sampler = RowSampler(params, prompt=prompt)
    sampler.accept([7, 8])  # committed: the next position sees them
    assert sampler.position_logprobs(logits[2:3], []).tolist() == scores[2:3].tolist()
    with pytest.raises(ValueError):
        own = RowSampler(SamplingParams(), prompt=prompt)
        own.add_processor(lambda tokens, x: x)
        own.position_logprobs(logits[:1], [])


def test_a_grammar_cuts_a_draft_where_it_refuses_and_masks_each_position_without_moving():
    """``allowed_prefix`` stops at the first refused token (and before EOS); ``draft_words`` gives the masks plain
    decoding would see after each draft token, and the grammar's state is left where it was."""
    import numpy as np

    from mlxkv.models import load
    from mlxkv.structured import json_schema_format
    from mlxkv.structured.constraint import make_constraint

    tokenizer = load().tokenizer
    fmt = json_schema_format({"type": "object", "properties": {"word": {"enum": ["red", "blue"]}},
                              "required": ["word"], "additionalProperties": False})
    doc = list(tokenizer.encode('{"word": "red"}', add_special_tokens=False))
    eos = next(iter(tokenizer.eos_token_ids))
    constraint = make_constraint(fmt, tokenizer)
    assert constraint.allowed_prefix(doc) == len(doc)
    assert constraint.allowed_prefix([*doc[:3], doc[0], *doc[4:]]) == 3
    assert constraint.allowed_prefix([*doc, eos, doc[0]]) == len(doc)  # nothing after the document's end
    before = constraint.words(2048)
    masks = constraint.draft_words(doc[:4], 2048)  # (5, 64)
    assert (constraint.words(2048) == before).all()  # rolled back
    walked = make_constraint(fmt, tokenizer)
    for i in range(5):
        assert (masks[i] == walked.words(2048)).all(), i
        if i < 4:
            walked.advance(doc[i])
    assert not (masks[1] == masks[0]).all()
    with pytest.raises(Exception):
        constraint.draft_words([doc[0], doc[0]], 2048)
    assert (constraint.words(2048) == before).all()  # a refused draft leaves the state too
    constraint.advance(doc[0])  # and the real matcher goes on
    assert (constraint.words(2048) == masks[1]).all() and np.any(masks[1])
