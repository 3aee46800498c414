"""Speculative decoding over a paged pool: greedy output equals plain dense greedy token for token (llama,
gemma3_text with a window of 8, llama4 with chunks of 16; prompt lookup, a draft model, and a scripted
drafter that makes every rewind length happen), the pool's invariants hold every round, every block comes
back after release, cached blocks only ever hold verified tokens, and a later prompt's prefix hit on them
gives the logits of a cold run."""

import mlx.core as mx
import pytest
from testkit.speculative import ScriptedDrafter, build, perturbed

from mlxkv.config import KvCacheConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.drafters import DraftModelDrafter, PromptLookupDrafter
from mlxkv.engine.sampling import SamplingParams
from mlxkv.engine.speculative import SpeculativeEngine
from mlxkv.kv.store import CachePool

pytestmark = pytest.mark.float_order

ARCHS = ["llama", "gemma3_text", "llama4"]
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(45)]  # past gemma3's window, across llama4 chunks
NEW_TOKENS = 30
K = 4
B = 4  # small blocks: every round crosses block boundaries


def paged_pool(model, num_blocks=160):
    config = KvCacheConfig(backend="paged", block_size=B)
    return CachePool(model, max_sequences=1, backend="paged", kv_config=config, num_blocks=num_blocks)


def cached_blocks_are_verified(pool, verified):
    """Every cached block's tokens sit at a block-aligned place of ``verified`` (no draft was cached)."""
    for block in pool.paged.manager.pool.blocks[1:]:
        if block.cached:
            toks = list(block.token_ids)
            assert any(verified[i:i + len(toks)] == toks for i in range(0, len(verified), B)), \
                f"cached block {block.block_id} holds unverified tokens {toks}"


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    """(arch, model, dense greedy reference)."""
    model = build(request.param)
    reference = list(DirectEngine(model, None).generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    assert len(set(reference)) > 1, "degenerate test model"
    return request.param, model, reference


def speculate(model, drafter, pool, prompt=PROMPT, max_tokens=NEW_TOKENS, salt=None, verified=None):
    """Run; every round check the pool's invariants, that the sequence holds only committed tokens and
    (given ``verified``, the greedy text) that no cached block holds a rejected draft."""
    rounds = []

    def on_round(seq, r):
        pool.check_invariants()
        if verified is not None:
            cached_blocks_are_verified(pool, verified)
        p = seq.paged
        assert p.num_tokens == r.verified_length == p.manager.num_committed(p.seq_id)
        for g, spec in enumerate(pool.paged.specs):  # the drafts' emptied tail blocks went back to the pool
            if spec.is_full:
                assert p.blocks_held(g) == -(-p.num_tokens // B)
        rounds.append(r)

    engine = SpeculativeEngine(model, None, drafter, num_draft_tokens=K, pool=pool, on_round=on_round)
    tokens = list(engine.generate_tokens(prompt, SamplingParams(max_tokens=max_tokens), salt=salt))
    assert len(pool) == 0
    pool.check_invariants()
    mgr = pool.paged.manager
    assert mgr.pool.num_free_blocks == mgr.pool.num_usable_blocks, "a block did not come back after release"
    return tokens, engine.last_stats, rounds


def test_scripted_every_rewind_length_then_verified_prefix_hit(case):
    _arch, model, reference = case
    pool = paged_pool(model)
    verified = PROMPT + reference[:-1]  # the newest token is never fed
    tokens, stats, rounds = speculate(model, ScriptedDrafter(reference), pool, verified=verified)
    assert tokens == reference
    assert {r.accepted for r in rounds if r.drafted == K} == set(range(K + 1)), "every rewind length"
    cached_blocks_are_verified(pool, verified)
    # Same prompt again: a prefix hit, same tokens.
    again, stats, _ = speculate(model, ScriptedDrafter(reference), pool)
    assert again == reference and stats.cached_prompt_tokens > 0
    # A prompt extending into the generated tokens hits blocks written by verify rounds: cold logits.
    longer = verified[:len(PROMPT) + 21]
    seq = pool.open(prompt=longer)
    try:
        assert seq.num_cached >= len(PROMPT) + 16
        hit = model(mx.array(longer[seq.num_cached:], dtype=mx.uint32)[None], cache=seq.caches)[0, -1]
    finally:
        pool.release(seq.id)
    dense = CachePool(model, max_sequences=1).open(len(longer))
    cold = model(mx.array(longer, dtype=mx.uint32)[None], cache=dense.caches)[0, -1]
    assert mx.abs(hit - cold).max().item() <= 1e-4 * max(1.0, mx.abs(cold).max().item())
    assert mx.argmax(hit).item() == mx.argmax(cold).item()


def test_prompt_lookup_is_exact(case):
    _arch, model, reference = case
    pool = paged_pool(model)
    tokens, stats, _ = speculate(model, PromptLookupDrafter(ngram_size=3), pool)
    assert tokens == reference and stats.drafted_tokens > 0
    cached_blocks_are_verified(pool, PROMPT + reference[:-1])


def test_draft_model_is_exact(case):
    arch, model, reference = case
    pool = paged_pool(model)
    drafter = DraftModelDrafter(perturbed(arch))  # dense draft pool
    tokens, stats, rounds = speculate(model, drafter, pool, verified=PROMPT + reference[:-1])
    assert tokens == reference and stats.accepted_tokens > 0
    assert any(r.accepted < r.drafted for r in rounds), "no partial round: the rewind path is untested"
    cached_blocks_are_verified(pool, PROMPT + reference[:-1])


def test_draft_model_pool_must_be_dense():
    model = build("llama")
    with pytest.raises(ValueError, match="dense"):
        DraftModelDrafter(model, pool=paged_pool(model))


def test_build_engine_paged_with_prompt_lookup():
    from types import SimpleNamespace

    from mlxkv.engine.build import build_engine
    from testkit.run_config import run_config

    model = build("llama")
    reference = list(DirectEngine(model, None).generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    options = run_config(kv_backend="paged", kv_block_size=B, prompt_lookup=True, num_draft_tokens=K)
    engine = build_engine(SimpleNamespace(model=model, tokenizer=None), options, len(PROMPT) + NEW_TOKENS)
    # prompt lookup speculates on the engine step (serve's verification rows), not in rounds
    assert not isinstance(engine, SpeculativeEngine) and engine.speculation is not None
    assert engine.pool.paged is not None
    tokens = list(engine.generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    assert tokens == reference
    assert engine.last_stats.drafted_tokens > 0
    engine.pool.check_invariants()


def test_cli_generate_paged_with_prompt_lookup_gives_the_dense_text(test_model_dir):
    from mlxkv.cli.main import app
    from typer.testing import CliRunner

    runner = CliRunner()
    args = ["generate", "-m", str(test_model_dir("llama")), "--raw", "-n", "16", "Lists are mutable sequences"]
    dense = runner.invoke(app, args)
    paged = runner.invoke(app, [*args, "--kv-backend", "paged", "--kv-block-size", "4", "--prompt-lookup",
                                "--verbose"])
    assert dense.exit_code == paged.exit_code == 0, paged.output
    assert paged.stdout == dense.stdout and "acceptance" in paged.stderr


def test_recurrent_model_replays_over_paged_pool():
    """qwen3_next (gated-delta layers): partial rounds rewind by replay; the replay is fed to the manager too."""
    model = build("qwen3_next")
    reference = list(DirectEngine(model, None).generate_tokens(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    tokens, stats, _ = speculate(model, ScriptedDrafter(reference), paged_pool(model))
    assert tokens == reference and stats.replay_forwards > 0
