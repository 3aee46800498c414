"""Sampled speculation keeps the target's distribution (rejection sampling), checked by chi-square tests on a
hand-built 8-token model whose exact sequence distribution is enumerable."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculative import SpeculativeEngine
from mlxkv.engine.verify import sampling_logprobs, verify_sampled
from mlxkv.kv.store import CachePool

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # periodic: prompt lookup finds matches
T = 4  # generated tokens per sample: the first from prefill, then speculation rounds


class ToyLM:
    """logits(context) = A[last token] + B[sum(context) % 3]. The context sum is read back from its KV cache
    (token ids stored as keys), so a cache holding a rejected token — or missing a kept one — changes the
    distribution. ``probs`` gives the same distribution in numpy."""

    def __init__(self, A: np.ndarray, B: np.ndarray):
        self.A, self.B = A.astype(np.float32), B.astype(np.float32)
        self._A, self._B = mx.array(self.A), mx.array(self.B)
        self.layers = [None]

    def __call__(self, inputs, cache):
        L = inputs.shape[1]
        kv = inputs.astype(mx.float32).reshape(1, 1, L, 1)  # (B, heads, L, D)
        keys, _ = cache[0].update_and_fetch(kv, kv)  # (1, 1, offset, 1)
        sums = mx.cumsum(keys[0, 0, :, 0])[-L:].astype(mx.int32) % 3  # (L,)
        return (self._A[inputs[0]] + self._B[sums])[None]  # (1, L, V)

    def probs(self, context: list[int], temp: float) -> np.ndarray:
        z = (self.A[context[-1]] + self.B[sum(context) % 3]) / temp
        e = np.exp(z - z.max())
        return e / e.sum()


def toy_pool(model):
    return CachePool(model, cache_factory=lambda _: [KVCache()])


def exact_distribution(model: ToyLM, temp: float) -> dict[tuple, float]:
    """P(t_0..t_{T-1} | PROMPT) for every sequence."""
    dist = {}
    for seq in itertools.product(range(V), repeat=T):
        ctx, p = list(PROMPT), 1.0
        for t in seq:
            p *= model.probs(ctx, temp)[t]
            ctx.append(t)
        dist[seq] = p
    return dist


def chi_square_ok(counts: dict, probs: dict, n: int, alpha_z: float = 3.7) -> tuple[float, float]:
    """Chi-square statistic (bins with expected < 5 merged) and its critical value at z = ``alpha_z``
    (Wilson-Hilferty; 3.7 is alpha ~ 1e-4)."""
    stat, rest_obs, rest_exp, bins = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        expected = n * p
        if expected < 5:
            rest_obs, rest_exp = rest_obs + counts.get(key, 0), rest_exp + expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        bins += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        bins += 1
    df = bins - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def marginal(dist: dict, idx: tuple) -> dict:
    out: dict = {}
    for seq, p in dist.items():
        key = tuple(seq[i] for i in idx)
        out[key] = out.get(key, 0.0) + p
    return out


rng = np.random.default_rng(0)
A = rng.normal(size=(V, V)) * 1.5
B = rng.normal(size=(3, V))
TARGET = ToyLM(A, B)
# Close enough to the target for mixed acceptance; far enough that accepting every draft would fail.
NEAR_DRAFT = ToyLM(A + 0.8 * rng.normal(size=(V, V)), B + 0.8 * rng.normal(size=(3, V)))
# A target that tends to continue the prompt's 1 2 3 cycle, so prompt lookup's point-mass drafts are often
# (not always) accepted.
CYCLIC = ToyLM(A + 2.5 * np.eye(V)[[(i % 3) + 1 for i in range(V)]], B)


@pytest.mark.parametrize("mode,temp,n", [("draft", 1.0, 1000), ("lookup", 0.8, 1000),
                                         pytest.param("step", 0.8, 1000, marks=pytest.mark.slow)])
def test_sampled_speculation_matches_target_distribution(mode, temp, n):
    """``step``: ``mlxkv generate --prompt-lookup``'s path, a DirectEngine speculating on the engine step."""
    if mode == "draft":
        target, drafter = TARGET, DraftModelDrafter(NEAR_DRAFT, pool=toy_pool(NEAR_DRAFT))
    else:
        target, drafter = CYCLIC, PromptLookupDrafter(ngram_size=2)
    if mode == "step":
        from mlxkv.engine.direct import DirectEngine
        from mlxkv.engine.speculation import Speculation

        engine = DirectEngine(target, None, pool=toy_pool(target), speculation=Speculation(3, 2))
    else:
        engine = SpeculativeEngine(target, None, drafter, num_draft_tokens=3, pool=toy_pool(target))
    mx.random.seed(1234)
    samples, accepted, drafted = [], 0, 0
    for _ in range(n):
        samples.append(tuple(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=T, temp=temp))))
        accepted += engine.last_stats.accepted_tokens
        drafted += engine.last_stats.drafted_tokens
    assert 0.1 < accepted / drafted < 0.9, "need both acceptances and rejections"
    exact = exact_distribution(target, temp)
    if mode == "draft":  # the test can tell: the draft's own distribution is far from the target's
        draft = exact_distribution(NEAR_DRAFT, temp)
        assert 0.5 * sum(abs(draft[s] - exact[s]) for s in exact) > 0.3
    for idx in [(1,), (2,), (3,), (1, 2), (2, 3)]:
        probs = marginal(exact, idx)
        counts: dict = {}
        for s in samples:
            key = tuple(s[i] for i in idx)
            counts[key] = counts.get(key, 0) + 1
        stat, critical = chi_square_ok(counts, probs, n)
        assert stat < critical, f"positions {idx}: chi2 {stat:.1f} >= {critical:.1f}"


def test_verify_sampled_one_round_distribution():
    """Accept/resample over k = 2 drafted tokens drawn from q: the first committed token is distributed as p_0,
    and given an acceptance, the second as p_1."""
    p = mx.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.1, 0.6, 0.1, 0.2], [0.4, 0.4, 0.1, 0.1]])
    mx.random.seed(5)
    n = 2500
    draws = mx.random.categorical(mx.log(q), axis=-1, num_samples=n).T.tolist()  # (n, 2)
    first, second = {}, {}
    for d in draws:
        verdict = verify_sampled(mx.log(p), d, mx.log(q))
        tokens = [*d[:verdict.accepted], verdict.token]
        first[(tokens[0],)] = first.get((tokens[0],), 0) + 1
        if len(tokens) > 1:
            second[(tokens[1],)] = second.get((tokens[1],), 0) + 1
    for counts, row in ((first, 0), (second, 1)):
        probs = {(i,): float(x) for i, x in enumerate(p[row].tolist())}
        stat, critical = chi_square_ok(counts, probs, sum(counts.values()))
        assert stat < critical, (row, counts)


def test_sampling_logprobs_is_the_samplers_distribution():
    """top-k / top-p / min-p / temperature: our explicit distribution equals what mlx-lm's sampler draws."""
    logits = mx.array([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.0]])
    params = SamplingParams(temp=0.7, top_k=5, top_p=0.9, min_p=0.05)
    lp = sampling_logprobs(logits, params)
    kept = [i for i, x in enumerate(lp[0].tolist()) if x > -math.inf]
    mx.random.seed(3)
    sampler = params.make_sampler()
    n = 4000
    draws = sampler(mx.broadcast_to(logits - mx.logsumexp(logits), (n, V))).tolist()
    assert set(draws) <= set(kept)
    counts: dict = {}
    for d in draws:
        counts[(d,)] = counts.get((d,), 0) + 1
    stat, critical = chi_square_ok(counts, {(i,): math.exp(x) for i, x in enumerate(lp[0].tolist())}, n)
    assert stat < critical


def test_prompt_lookup_greedy_on_a_repeating_model_is_exact_and_fast():
    """Greedy on a model that continues the prompt's cycle: lookup drafts are accepted, output exact."""
    from mlxkv.engine.direct import DirectEngine

    params = SamplingParams(max_tokens=30)
    expected = list(DirectEngine(CYCLIC, None, pool=toy_pool(CYCLIC)).generate_tokens(PROMPT, params))
    engine = SpeculativeEngine(CYCLIC, None, PromptLookupDrafter(ngram_size=3), num_draft_tokens=4,
                               pool=toy_pool(CYCLIC))
    assert list(engine.generate_tokens(PROMPT, params)) == expected
    stats = engine.last_stats
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_forward > 4


class _NoEosTokenizer:
    """What the engine step's text streams need of a tokenizer: no EOS, a detokenizer that writes nothing."""

    eos_token_ids: set = set()

    class _Detokenizer:
        last_segment = ""

        def add_token(self, token):
            pass

        def finalize(self):
            pass

    @property
    def detokenizer(self):
        return self._Detokenizer()


@pytest.mark.slow
def test_engine_step_sampled_speculation_keeps_the_target_distribution():
    """``mlxkv serve --prompt-lookup``'s path: 16 requests decode together in the engine step (the scheduler's
    verification rows, each accepting its own prefix by rejection sampling), at temperature 1."""
    from mlxkv.engine.request import GenerationRequest, RequestHandle
    from mlxkv.engine.scheduler import Job, Scheduler
    from mlxkv.engine.speculation import Speculation

    n, temp = 1000, 1.0
    sched = Scheduler(CYCLIC, _NoEosTokenizer(), toy_pool(CYCLIC), max_sequences=16, batched=False,
                      speculation=Speculation(num_draft_tokens=3, ngram_size=2))
    mx.random.seed(4321)
    jobs = []
    for _ in range(n):
        request = GenerationRequest(list(PROMPT), SamplingParams(max_tokens=T, temp=temp))
        jobs.append(Job(request=request, handle=RequestHandle(request), max_tokens=T))
        sched.add(jobs[-1])
    while sched.has_work():
        sched.step()
    samples = [tuple(e.token for e in job.handle if e.kind == "token") for job in jobs]
    assert all(len(s) == T for s in samples)
    totals = sched.totals
    assert totals["max_batch"] == 16 and totals["verify_steps"] > 0
    assert 0.1 < totals["accepted_draft_tokens"] / totals["draft_tokens"] < 0.9, "need acceptances and rejections"
    exact = exact_distribution(CYCLIC, temp)
    for idx in [(1,), (2,), (3,), (1, 2), (2, 3)]:
        probs = marginal(exact, idx)
        counts: dict = {}
        for s in samples:
            key = tuple(s[i] for i in idx)
            counts[key] = counts.get(key, 0) + 1
        stat, critical = chi_square_ok(counts, probs, n)
        assert stat < critical, f"positions {idx}: chi2 {stat:.1f} >= {critical:.1f}"


def test_a_penalised_biased_row_keeps_its_processed_distribution_through_verification():
    """A sampled verification row with presence and frequency penalties and a logit bias (``verify_rows``, the
    engine step's acceptance): its first committed token is distributed as the processed ``p_0``, and after an
    accepted draft token ``d_1`` its second as ``p_1`` processed over the history extended by ``d_1`` — the
    penalties move ``d_1``'s own probability there, so a history without it would fail."""
    from mlxkv.engine.row_sampler import RowSampler
    from mlxkv.engine.verify_rows import verify_rows

    params = SamplingParams(temp=1.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={2: 1.0})
    prompt, draft = [0, 1], [3, 3]
    logits = mx.array(np.random.default_rng(7).normal(size=(1, 3, V)).astype(np.float32))
    logits[0, :, 3] += 1.5  # the drafted token is likely at first, much less once it has been seen

    def processed(i):  # what plain decoding draws from after draft[:i]
        row = logits[0, i : i + 1]
        for process in params.processors():
            row = process(mx.array(prompt + draft[:i]), row)
        return mx.softmax(row, axis=-1)[0].tolist()

    mx.random.seed(11)
    n, first, second = 1000, {}, {}
    for _ in range(n):
        tokens = verify_rows(logits, [draft], [RowSampler(params, prompt=prompt)])[0]
        first[(tokens[0],)] = first.get((tokens[0],), 0) + 1
        if len(tokens) > 1:
            second[(tokens[1],)] = second.get((tokens[1],), 0) + 1
    p1 = processed(1)
    assert p1[3] < 0.5 * mx.softmax(logits[0, 1], axis=-1)[3].item()  # the penalties act on the draft's token
    for counts, probs in ((first, processed(0)), (second, p1)):
        stat, critical = chi_square_ok(counts, {(i,): p for i, p in enumerate(probs)}, sum(counts.values()))
        assert stat < critical, (counts, probs)
