"""SpeculativeEngine: greedy output equals plain greedy decoding token for token, on every test architecture,
for prompt lookup and draft models (self-draft: high acceptance; other seed: near zero; perturbed: mixed) and
for a scripted drafter whose rounds accept 0..k tokens in turn, so every rewind length happens — across
wrapped sliding windows (gemma3, window 8) and chunk boundaries (llama4, chunk 16) too."""

import mlx.core as mx
import pytest
from testkit.archs import ARCHITECTURES, TEST_VOCAB_SIZE
from testkit.speculative import ScriptedDrafter, build, perturbed

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.drafters import Draft, DraftModelDrafter, PromptLookupDrafter
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculative import SpeculativeEngine, SpeculativeStats
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.store import CachePool
from mlxkv.models import load

pytestmark = pytest.mark.float_order

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # past gemma3's window, across llama4 chunks
NEW_TOKENS = 40  # generation crosses llama4's chunk starts at 48, 64 and 80
K = 4
LAYOUT = "mlxkv"


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_case(request):
    """(arch, target model, reference greedy tokens from DirectEngine)."""
    arch = request.param
    model = build(arch)
    direct = DirectEngine(model, None, pool=CachePool(model, layout=LAYOUT))
    reference = list(direct.generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    assert len(set(reference)) > 1, "degenerate test model"
    return arch, model, reference


def speculate(model, drafter, k=K, on_round=None, max_tokens=NEW_TOKENS, prompt=PROMPT):
    engine = SpeculativeEngine(model, None, drafter, num_draft_tokens=k, on_round=on_round,
                               pool=CachePool(model, layout=LAYOUT))
    tokens = list(engine.generate_tokens(prompt, SamplingParams(max_tokens=max_tokens)))
    assert len(engine.pool) == 0, "target sequence not released"
    return tokens, engine.last_stats


def draft_model(model):
    return DraftModelDrafter(model, pool=CachePool(model, layout=LAYOUT))


def test_scripted_rewinds_of_every_length(arch_case):
    arch, model, reference = arch_case
    rounds = []
    tokens, stats = speculate(model, ScriptedDrafter(reference), on_round=lambda seq, r: rounds.append(r))
    assert tokens == reference
    assert {r.accepted for r in rounds if r.drafted == K} == set(range(K + 1)), "every rewind length"
    assert stats.rounds == len(rounds) and stats.decoded_tokens == NEW_TOKENS - 1
    # Verified lengths grow by the committed tokens; the caches never keep a rejected token.
    lengths = [len(PROMPT)] + [r.verified_length for r in rounds]
    assert all(b - a == len(r.tokens) for a, b, r in zip(lengths, lengths[1:], rounds))
    assert [t for r in rounds for t in r.tokens] == reference[1:]
    if arch == "llama4":  # some rejection must rewind from one 16-token chunk back into the previous one
        fed_ends = [a + r.drafted + 1 for a, r in zip(lengths, rounds)]
        assert any((end - 1) // 16 > (b - 1) // 16 for end, b in zip(fed_ends, lengths[1:]))


def test_prompt_lookup_greedy_is_exact(arch_case):
    _, model, reference = arch_case
    # A prompt with repeated n-grams, so lookups propose; random models rarely follow them (mostly rejections).
    prompt = PROMPT + reference[:20] + PROMPT[-6:]
    direct = DirectEngine(model, None, pool=CachePool(model, layout=LAYOUT))
    expected = list(direct.generate_tokens(prompt, SamplingParams(max_tokens=NEW_TOKENS)))
    tokens, stats = speculate(model, PromptLookupDrafter(ngram_size=3), prompt=prompt)
    assert tokens == expected
    assert stats.drafted_tokens > 0


def test_self_draft_greedy_is_exact_with_high_acceptance(arch_case):
    _, model, reference = arch_case
    tokens, stats = speculate(model, draft_model(model))
    assert tokens == reference
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_forward > 3.5


def test_other_seed_draft_greedy_is_exact(arch_case):
    arch, model, reference = arch_case
    other = build(arch, seed=1)
    tokens, stats = speculate(model, draft_model(other))
    assert tokens == reference
    assert stats.acceptance_rate < 0.5 and stats.drafted_tokens > stats.accepted_tokens
    # Only the hybrid model (recurrent layer 0) replays kept tokens after a rejection.
    assert (stats.replay_forwards > 0) == (arch == "qwen3_next")


def test_perturbed_draft_greedy_is_exact_with_partial_rounds(arch_case):
    arch, model, reference = arch_case
    rounds = []
    tokens, _ = speculate(model, draft_model(perturbed(arch, 0.03)), on_round=lambda s, r: rounds.append(r))
    assert tokens == reference
    assert any(r.accepted > 0 for r in rounds) and any(r.accepted < r.drafted for r in rounds)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "llama4", "qwen3_next"])
def test_draft_model_caches_follow_the_committed_tokens(arch):
    """After any accept/reject pattern the draft model proposes exactly its own greedy continuation of the
    committed text: its caches (rotating, chunked, recurrent restored from snapshots) were rewound right."""
    draft = build(arch, seed=1)
    drafter = draft_model(draft)
    direct = DirectEngine(draft, None, pool=CachePool(draft, layout=LAYOUT))
    context = [*PROMPT, 500]
    drafter.begin(PROMPT, SamplingParams(), vocab_size=TEST_VOCAB_SIZE, max_draft=K)
    drafter.commit(Draft([]), 0, 500)
    for accepted in [0, 2, K, 1, K, 3, 0]:
        proposal = drafter.propose(K)
        assert proposal.tokens == list(direct.generate_tokens(context, SamplingParams(max_tokens=K)))
        token = (proposal.tokens[accepted] + 1) % TEST_VOCAB_SIZE if accepted < K else 7
        drafter.commit(proposal, accepted, token)
        context += [*proposal.tokens[:accepted], token]
    drafter.end()
    assert len(drafter.pool) == 0


def wide(arch: str):
    """The ``arch`` test model with head_dim 32, so K/V can be quantized (group size >= 32)."""
    from mlx_lm.utils import _get_classes
    from testkit.archs import _init_weights, get_config

    config = get_config(arch)
    config.update(hidden_size=128, head_dim=32)
    model_class, args_class = _get_classes(config=config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    _init_weights(model, 0)
    mx.eval(model.parameters())
    install_attention_hook(model)
    return model


@pytest.mark.parametrize("options", [{"kv_bits": 8, "kv_group_size": 32}, {"max_kv_size": 32}],
                         ids=["kv8", "max_kv32"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_quantized_and_capped_caches_are_exact(arch, options):
    """Quantized K/V (rotating too, on gemma3) and full-attention layers capped into rotating caches with
    sink tokens (wrapped: the prompt alone is longer than 32)."""
    model = wide(arch)
    step = 16  # prefill chunks under the cap: a 45-token chunk into a capped cache fails in its mask today
    expected = list(DirectEngine(model, None, pool=CachePool(model, **options), prefill_step_size=step)
                    .generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    for d in (DraftModelDrafter(model, pool=CachePool(model, **options), prefill_step_size=step),
              ScriptedDrafter(expected)):
        engine = SpeculativeEngine(model, None, d, num_draft_tokens=K, pool=CachePool(model, **options),
                                   prefill_step_size=step)
        assert list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS))) == expected


@pytest.mark.parametrize("arch", ["gemma3_text", "llama4"])
def test_mlx_lm_layouts_that_cannot_rewind_are_refused(arch):
    model = build(arch)
    engine = SpeculativeEngine(model, None, PromptLookupDrafter(), pool=CachePool(model, layout="mlx-lm"))
    with pytest.raises(ValueError, match="rewind exactly"):
        list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=4)))
    assert len(engine.pool) == 0


def test_mlx_lm_full_attention_layout_is_exact():
    model = build("llama")
    expected = list(DirectEngine(model, None, pool=CachePool(model, layout="mlx-lm"))
                    .generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    engine = SpeculativeEngine(model, None, DraftModelDrafter(model, pool=CachePool(model, layout="mlx-lm")),
                               pool=CachePool(model, layout="mlx-lm"))
    assert list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS))) == expected


def test_invalid_arguments():
    model = build("llama")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeEngine(model, None, PromptLookupDrafter(), num_draft_tokens=0)
    with pytest.raises(ValueError, match="ngram_size"):
        PromptLookupDrafter(ngram_size=0)
    with pytest.raises(ValueError, match="min_ngram_size"):
        PromptLookupDrafter(ngram_size=2, min_ngram_size=3)
    engine = SpeculativeEngine(model, None, PromptLookupDrafter())
    with pytest.raises(ValueError, match="empty"):
        list(engine.generate_tokens([], SamplingParams()))


def test_draft_vocabulary_mismatch_is_refused():
    from mlx_lm.models.llama import Model, ModelArgs

    model = build("llama")
    small = Model(ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=512))
    drafter = draft_model(small)
    engine = SpeculativeEngine(model, None, drafter, pool=CachePool(model, layout=LAYOUT))
    with pytest.raises(ValueError, match="vocabulary"):
        list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=4)))
    assert len(engine.pool) == 0 and len(drafter.pool) == 0


def test_sampled_speculation_runs_and_is_reproducible():
    model = build("qwen3_next")  # recurrent layers: rejected rounds restore + replay
    params = SamplingParams(max_tokens=30, temp=0.8, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        drafter = draft_model(perturbed("qwen3_next", 0.03))
        engine = SpeculativeEngine(model, None, drafter, pool=CachePool(model, layout=LAYOUT))
        runs.append((list(engine.generate_tokens(PROMPT, params)), engine.last_stats))
    (first, stats), (second, _) = runs
    assert first == second and len(first) == 30
    assert stats.accepted_tokens > 0 and stats.replay_forwards > 0


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def test_generate_streams_and_stops_like_direct(llama):
    direct = DirectEngine(llama.model, llama.tokenizer, pool=CachePool(llama.model, layout=LAYOUT))
    full = "".join(c.text for c in direct.generate(PROMPT, SamplingParams(max_tokens=20)))
    stop = full.strip()[5:9]
    assert stop.strip(), "need a non-blank stop string"
    drafter = DraftModelDrafter(llama.model, pool=CachePool(llama.model, layout=LAYOUT))
    engine = SpeculativeEngine(llama.model, llama.tokenizer, drafter, pool=CachePool(llama.model, layout=LAYOUT))
    for params in (SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, stop=(stop,))):
        want = list(direct.generate(PROMPT, params))
        got = list(engine.generate(PROMPT, params))
        assert got == want
        assert len(engine.pool) == 0 and len(drafter.pool) == 0
    assert got[-1].finish_reason == "stop" and stop not in "".join(c.text for c in got)


def test_eos_inside_an_accepted_draft_ends_generation(llama):
    engine = SpeculativeEngine(llama.model, llama.tokenizer, DraftModelDrafter(llama.model),
                               pool=CachePool(llama.model, layout=LAYOUT))
    greedy = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=12)))
    llama.tokenizer.eos_token_ids = {greedy[6]}  # self-draft accepts whole rounds: EOS lands mid-round
    try:
        chunks = list(engine.generate(PROMPT, SamplingParams(max_tokens=12)))
    finally:
        llama.tokenizer.eos_token_ids = {2}
    assert len(chunks) == greedy.index(greedy[6]) + 1 and chunks[-1].finish_reason == "stop"
    assert [c.token for c in chunks] == greedy[:len(chunks)]


def test_early_close_releases_target_and_draft_sequences(llama):
    drafter = DraftModelDrafter(llama.model)
    engine = SpeculativeEngine(llama.model, llama.tokenizer, drafter)
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=50))
    next(stream), next(stream)
    assert len(engine.pool) == 1 and len(drafter.pool) == 1
    stream.close()
    assert len(engine.pool) == 0 and len(drafter.pool) == 0


def test_stats(llama):
    engine = SpeculativeEngine(llama.model, llama.tokenizer, DraftModelDrafter(llama.model), num_draft_tokens=3)
    tokens = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=13)))
    stats = engine.last_stats
    assert isinstance(stats, SpeculativeStats)
    assert stats.prompt_tokens == len(PROMPT) and stats.generation_tokens == len(tokens) == 13
    # Self-draft accepts everything: 12 decoded tokens in rounds of 3 drafts + 1 -> 3 forwards.
    assert (stats.rounds, stats.drafted_tokens, stats.accepted_tokens) == (3, 9, 9)
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_forward == 4.0
    assert stats.kv_bytes > 0 and stats.generation_tps > 0
