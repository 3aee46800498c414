"""Paged-attention reference vs dense SDPA (gather, explicit mask) over sampled random shapes."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags
from testkit.kernel_oracle import dense_paged_attention

from mlxkv.kernels import TOLERANCES, paged_attention_reference, plan_splits
from mlxkv.kernels.geometry import visible_page_bound
from mlxkv.kernels.selfcheck import max_abs_error, random_paged_case

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def sampled_cases(n: int, seed: int = 0):
    """A fixed random sample of the grid: GQA 1/4/8, D 64/128, block 16/32, splits, options."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        block_size = rng.choice([16, 32])
        lens = [rng.randint(1, 12 * block_size) for _ in range(rng.randint(1, 4))]
        lens[0] = rng.randint(1, 6) * block_size + rng.randint(1, block_size - 1)  # partial last page
        cases.append(dict(
            dtype=rng.choice(list(DTYPES)),
            gqa=rng.choice([1, 4, 8]),
            head_dim=rng.choice([64, 128]),
            block_size=block_size,
            num_splits=rng.choice([1, 2, 4]),
            option=("none", "window", "chunk", "sinks")[i % 4],
            window=rng.randint(1, 5 * block_size),
            chunk_size=rng.choice([block_size, 2 * block_size, 3 * block_size - 5, 100]),
            lens=lens,
            seed=i,
        ))
    return cases


def case_id(c):
    return f"{c['dtype']}-g{c['gqa']}-d{c['head_dim']}-bs{c['block_size']}-s{c['num_splits']}-{c['option']}"


@pytest.mark.parametrize("c", sampled_cases(24), ids=case_id)
def test_reference_matches_dense_sdpa(c):
    dtype = DTYPES[c["dtype"]]
    case = random_paged_case(dtype=dtype, head_dim=c["head_dim"], block_size=c["block_size"], kv_heads=2,
                             gqa=c["gqa"], context_lens=c["lens"], sinks=c["option"] == "sinks",
                             seed=c["seed"])
    kw = {"sinks": case.sinks}
    if c["option"] == "window":
        kw["window"] = c["window"]
    if c["option"] == "chunk":
        kw["chunk_size"] = c["chunk_size"]
    got = paged_attention_reference(*case.args(), num_splits=c["num_splits"], **kw)
    want = dense_paged_attention(*case.args(), **kw)
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOLERANCES[dtype]
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), (
        max_abs_error(got, want)
    )


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 7])
def test_split_count_does_not_change_the_result(num_splits):
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[200, 33, 1], seed=5)
    one = paged_attention_reference(*case.args(), num_splits=1)
    many = paged_attention_reference(*case.args(), num_splits=num_splits)
    assert mx.allclose(one, many, atol=1e-6, rtol=1e-6).item()


def test_window_and_chunk_change_the_answer():
    # The masks matter: a sliding/chunked result differs from full attention at the same inputs.
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=1,
                             context_lens=[150], seed=2)
    full = paged_attention_reference(*case.args())
    assert max_abs_error(full, paged_attention_reference(*case.args(), window=20)) > 1e-3
    assert max_abs_error(full, paged_attention_reference(*case.args(), chunk_size=64)) > 1e-3


def test_window_visits_only_in_window_pages():
    # A poisoned page outside the window (NaN) must not be read; inside it, it must be.
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[160], seed=4)
    table = case.block_tables.tolist()[0]
    poisoned_k = case.k_pages.astype(mx.float32)
    poisoned_k[:, table[0]] = mx.nan  # positions 0..15
    args = (case.queries, poisoned_k, case.v_pages, case.block_tables, case.context_lens)
    out = paged_attention_reference(*args, window=40, num_splits=2)
    assert not mx.any(mx.isnan(out)).item()
    assert mx.allclose(out, dense_paged_attention(*case.args(), window=40), atol=1e-6, rtol=1e-6).item()
    assert mx.any(mx.isnan(paged_attention_reference(*args))).item()  # full attention reads page 0


def test_context_lens_host_bound_is_equivalent():
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[90, 17], seed=6)
    a = paged_attention_reference(*case.args())
    b = paged_attention_reference(*case.args(), max_context_len=90)
    assert mx.array_equal(a, b).item()


def test_split_plan_env_override(monkeypatch):
    assert plan_splits(16384, 16).num_splits == 8  # one split per 2K tokens by default
    monkeypatch.setenv("MLXKV_PAGED_DECODE_SPLITS", "3")
    reload_flags()
    plan = plan_splits(16384, 16)
    assert (plan.num_splits, plan.pages_per_split) == (3, 342)
    assert plan_splits(20, 16).num_splits == 2  # never more splits than pages


@pytest.mark.parametrize("window, chunk", [(1, None), (16, None), (17, None), (None, 32), (None, 40)])
def test_visible_page_bound_covers_every_position(window, chunk):
    bs = 16
    bound = visible_page_bound(10_000, bs, window, chunk)
    for L in range(1, 400):
        start = 0
        if window is not None:
            start = max(start, L - window)
        if chunk is not None:
            start = max(start, (L - 1) // chunk * chunk)
        assert (L - 1) // bs - start // bs + 1 <= bound


def test_bad_inputs_raise_value_error():
    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[20], seed=0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_reference(case.queries[:, :7], *case.args()[1:])
    with pytest.raises(ValueError, match="window"):
        paged_attention_reference(*case.args(), window=0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_reference(*case.args()[:3], case.block_tables.astype(mx.int64), case.context_lens)


@pytest.mark.parametrize("kw", [{}, {"window": 37}, {"chunk_size": 48}], ids=["full", "window", "chunk"])
def test_single_pass_matches_the_split_path_and_zeroes_empty_sequences(kw, monkeypatch):
    # One split without sinks runs ReferencePagedAttention.single_pass (gather + softmax); the online-softmax
    # partials + merge path (what the Metal kernel mirrors) must give the same answer, and a sequence with
    # no visible token (context 0, a padding row) must come out as zeros in both.
    from mlxkv.kernels import paged_attention_ref
    from mlxkv.kernels.paged_attention_ref import REFERENCE

    case = random_paged_case(dtype=mx.float32, head_dim=64, block_size=16, kv_heads=2, gqa=4,
                             context_lens=[150, 1, 77], seed=8)
    lens = mx.array([150, 0, 77], dtype=mx.int32)
    args = (case.queries, case.k_pages, case.v_pages, case.block_tables, lens)
    plan = plan_splits(150, 16, num_splits=1, **kw)
    single = REFERENCE.single_pass(*args, plan, scale=0.125, window=kw.get("window"),
                                   chunk_size=kw.get("chunk_size"))
    o_part, lse = REFERENCE.partials(*args, plan, scale=0.125, window=kw.get("window"),
                                     chunk_size=kw.get("chunk_size"))
    split = REFERENCE.merge(o_part, lse, None, mx.float32)
    assert single is not None
    assert mx.allclose(single, split, atol=1e-6, rtol=1e-6).item(), max_abs_error(single, split)
    assert not mx.any(single[1]).item()
    # Past the single-pass size bound the public entry point falls back to partials + merge.
    monkeypatch.setattr(paged_attention_ref, "SINGLE_PASS_ELEMENTS", 1)
    assert REFERENCE.single_pass(*args, plan, scale=0.125, window=None, chunk_size=None) is None
    fallback = paged_attention_reference(*args, scale=0.125, num_splits=1, **kw)
    assert mx.allclose(fallback, split, atol=1e-6, rtol=1e-6).item()
