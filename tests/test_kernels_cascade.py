"""Cascade (shared-prefix) attention: grouping rules and exactness against flat attention."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.env import reload as reload_flags
from testkit.kernel_oracle import dense_paged_attention

from mlxkv.kernels import (
    TOLERANCES,
    KernelDispatch,
    PrefixGroup,
    cascade_attention,
    find_prefix_groups,
    paged_attention_reference,
)
from mlxkv.kernels.cascade import worth_cascading
from mlxkv.kernels.paged_attention_ref import REFERENCE
from mlxkv.kernels.selfcheck import max_abs_error, random_paged_case


def shared_case(*, dtype=mx.float32, gqa=4, head_dim=64, bs=16, lens, share, sinks=False, seed=0):
    """Random case where rows in each ``share`` entry (rows, pages) reuse row rows[0]'s first pages."""
    case = random_paged_case(dtype=dtype, head_dim=head_dim, block_size=bs, kv_heads=2, gqa=gqa,
                             context_lens=lens, sinks=sinks, seed=seed)
    table = case.block_tables.tolist()
    for rows, pages in share:
        for r in rows[1:]:
            table[r][:pages] = table[rows[0]][:pages]
    case.block_tables = mx.array(table, dtype=mx.int32)
    return case


def test_groups_follow_shared_whole_pages():
    bs = 16
    a, b, c = [5, 6, 7, 8], [9, 10, 11, 0], [12, 13, 14, 15]
    tables = [
        a,
        [5, 6, 20, 21],  # shares 2 pages with row 0
        [5, 6, 7, 30],  # shares 3 pages with row 0, 2 with row 1
        b,
        c,
        [12, 13, 40, 41],  # shares 2 with row 4
        [0, 0, 0, 0],  # empty row (first block is the null block)
    ]
    lens = [60, 64, 49, 40, 64, 33, 0]
    groups = find_prefix_groups(tables, lens, bs, min_group=2, min_shared_pages=1)
    # rows 0-2: common prefix 2 pages; row 5 (L=33) keeps its current token as suffix -> 2 pages.
    assert groups == [PrefixGroup(rows=(0, 1, 2), shared_pages=2), PrefixGroup(rows=(4, 5), shared_pages=2)]
    assert find_prefix_groups(tables, lens, bs, min_group=3, min_shared_pages=1) == [groups[0]]
    assert find_prefix_groups(tables, lens, bs, min_group=2, min_shared_pages=3) == []
    # A page that is full for every member but would leave one member no suffix is not shared.
    assert find_prefix_groups([a, [5, 6, 7, 9]], [48, 64], bs, min_group=2, min_shared_pages=1) == [
        PrefixGroup(rows=(0, 1), shared_pages=2)
    ]


def test_group_defaults_come_from_env(monkeypatch):
    tables, lens = [[5, 6, 7], [5, 6, 8]], [40, 40]
    monkeypatch.setenv("MLXKV_CASCADE_MIN_SHARED_PAGES", "3")
    reload_flags()
    assert find_prefix_groups(tables, lens, 16) == []
    monkeypatch.setenv("MLXKV_CASCADE_MIN_SHARED_PAGES", "2")
    reload_flags()
    assert find_prefix_groups(tables, lens, 16) == [PrefixGroup(rows=(0, 1), shared_pages=2)]
    monkeypatch.setenv("MLXKV_CASCADE_MIN_GROUP", "3")
    reload_flags()
    assert find_prefix_groups(tables, lens, 16) == []


CASES = [
    dict(dtype=mx.float32, gqa=4, lens=[100, 70, 130, 40, 55], share=[((0, 1, 2), 4), ((3, 4), 2)],
         sinks=True, splits=None),
    dict(dtype=mx.float32, gqa=1, lens=[33, 33, 33], share=[((0, 1, 2), 2)], sinks=False, splits=2),
    dict(dtype=mx.float32, gqa=8, lens=[300, 290, 17], share=[((0, 1), 18)], sinks=False, splits=4),
    dict(dtype=mx.float16, gqa=4, lens=[200, 180, 150, 90], share=[((0, 1, 2, 3), 5)], sinks=True, splits=3),
    dict(dtype=mx.bfloat16, gqa=4, lens=[80, 96], share=[((0, 1), 5)], sinks=False, splits=1),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"{c['dtype']}-g{c['gqa']}-{len(c['lens'])}seq")
def test_cascade_equals_flat_attention(c):
    case = shared_case(dtype=c["dtype"], gqa=c["gqa"], lens=c["lens"], share=c["share"], sinks=c["sinks"],
                       seed=len(c["lens"]))
    groups = find_prefix_groups(case.block_tables.tolist(), c["lens"], 16, min_group=2, min_shared_pages=1)
    assert {g.rows for g in groups} == {rows for rows, _ in c["share"]}
    got = cascade_attention(lambda g: REFERENCE, *case.args(), groups, sinks=case.sinks,
                            num_splits=c["splits"])
    flat = paged_attention_reference(*case.args(), sinks=case.sinks, num_splits=c["splits"])
    dense = dense_paged_attention(*case.args(), sinks=case.sinks)
    tol = TOLERANCES[c["dtype"]]
    assert got.dtype == c["dtype"]
    for want in (flat, dense):
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), (
            max_abs_error(got, want)
        )


class CountingReference:
    """The reference with a small ``max_gqa`` (like the Metal kernel's), recording each pass."""

    def __init__(self, max_gqa):
        self.max_gqa = max_gqa
        self.shared_query_heads = []

    def partials(self, queries, *args, **kwargs):
        self.shared_query_heads.append(queries.shape[1])
        return REFERENCE.partials(queries, *args, **kwargs)

    def merge(self, *args):
        return REFERENCE.merge(*args)


def test_shared_pass_is_one_pass_per_group_or_per_allowed_slice():
    case = shared_case(gqa=2, lens=[100, 90, 80, 70, 60], share=[((0, 1, 2, 3, 4), 3)], seed=3)
    groups = find_prefix_groups(case.block_tables.tolist(), [100, 90, 80, 70, 60], 16, min_group=2,
                                min_shared_pages=1)
    flat = paged_attention_reference(*case.args())
    whole = CountingReference(max_gqa=None)
    out = cascade_attention(lambda g: whole, *case.args(), groups)
    assert whole.shared_query_heads == [4, 2 * 2 * 5]  # suffix pass (H=4), one shared pass
    sliced = CountingReference(max_gqa=4)  # two rows' queries per shared pass
    out2 = cascade_attention(lambda g: sliced, *case.args(), groups)
    assert sliced.shared_query_heads == [4, 8, 8, 4]
    for o in (out, out2):
        assert mx.allclose(o, flat, atol=1e-6, rtol=1e-6).item()


def test_dispatch_cascades_the_groups_it_is_given():
    lens = [120, 100, 77]
    case = shared_case(lens=lens, share=[((0, 1, 2), 4)], sinks=True, seed=9)
    flat = paged_attention_reference(*case.args(), sinks=case.sinks)
    seen = CountingReference(max_gqa=None)
    dispatch = KernelDispatch(attention_factory=lambda *key: seen, metal_available=lambda: True,
                              mode=lambda: "auto")
    groups = find_prefix_groups(case.block_tables.tolist(), lens, 16, min_group=2, min_shared_pages=1)
    out = dispatch.paged_attention(*case.args(), sinks=case.sinks, prefix_groups=groups)
    assert mx.allclose(out, flat, atol=1e-6, rtol=1e-6).item()
    assert 4 * 3 * 2 in seen.shared_query_heads  # the grouped pass ran (3 rows x gqa 4 x 2 kv heads)
    # Without groups, or on windowed layers, attention is flat.
    for kw in ({}, {"window": 50, "prefix_groups": groups}):
        seen.shared_query_heads.clear()
        dispatch.paged_attention(*case.args(), **kw)
        assert all(h == 8 for h in seen.shared_query_heads) and seen.shared_query_heads


def test_worth_cascading_needs_a_long_prefix_that_is_half_of_every_context():
    groups = [PrefixGroup(rows=(0, 1), shared_pages=160), PrefixGroup(rows=(2, 3), shared_pages=130)]
    # group 0: 2560 of 5000 and 4000 tokens; group 1: 2080 of 4000 but of 4200 too few
    assert worth_cascading(groups, [5000, 4000, 4000, 4200], 16) == [groups[0]]
    assert worth_cascading(groups, [5000, 5200, 4100, 4100], 16) == [groups[1]]
    short = [PrefixGroup(rows=(0, 1), shared_pages=100)]  # 1600 tokens: below MIN_SHARED_TOKENS
    assert worth_cascading(short, [1700, 1700], 16) == []


def test_batched_decode_on_the_kernel_path_cascades_shared_prefixes(monkeypatch):
    # Where the paged kernel runs (Metal; forced here), a batch sharing a system prompt cascades it,
    # and the logits still equal each sequence decoded alone over dense caches.
    from test_paged_batch import decode_batched_vs_dense, prefill
    from testkit.archs import build_model

    import mlxkv.kernels.dispatch as dispatch_module
    import mlxkv.kv.batching.attention_backends as paged_views
    from mlxkv.config import KvCacheConfig
    from mlxkv.kv.layouts import install_attention_hook
    from mlxkv.kv.store import CachePool

    calls = []
    real = dispatch_module.cascade_attention
    monkeypatch.setattr(dispatch_module, "cascade_attention",
                        lambda *a, **k: calls.append([g.shared_pages for g in a[6]]) or real(*a, **k))
    monkeypatch.setattr(paged_views, "reference_on_views", lambda: False)
    import mlxkv.kernels.cascade as cascade_module

    monkeypatch.setattr(cascade_module, "MIN_SHARED_TOKENS", 16)  # a tiny model's short prompts
    model, _ = build_model("llama")
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200, kv_config=KvCacheConfig(backend="paged", block_size=4))
    system = [(5 * i) % 900 + 10 for i in range(30)]
    prompts = [system + [100 + k, 200 + k, 300 + k][: k + 1] for k in range(3)]
    seqs, dense, tokens = prefill(model, pool, prompts)
    decode_batched_vs_dense(model, seqs, dense, tokens)
    assert calls and all(c == [7] for c in calls)  # 7 shared pages of 4 tokens, >= half of each context
    for seq in seqs:
        pool.release(seq.id)
    pool.check_invariants()


# ---- the pure-MLX shared-prefix path (batch decode on CPU) ---------------------------------------------------
def consecutive_prefix(case, rows, pages, first):
    """Give ``rows`` the consecutive pool pages ``first .. first + pages - 1`` as their shared prefix (the pool
    is big enough: random_paged_case numbers blocks from 1 and the test keeps ``first`` inside it)."""
    table = case.block_tables.tolist()
    for r in rows:
        table[r][:pages] = list(range(first, first + pages))
    case.block_tables = mx.array(table, dtype=mx.int32)


@pytest.mark.parametrize("layout", ["consecutive", "two runs", "scattered"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_shared_prefix_attention_equals_flat(layout, gqa):
    """Groups (one of all but two rows, one of two rows), a row in no group, ragged lengths: equal to flat
    attention; shared pages in a few runs are read as views run by run, scattered ones gathered once."""
    from mlxkv.kernels.page_views_ref import shared_prefix_attention

    bs = 16
    lens = [70, 65, 100, 49, 90, 40]
    case = shared_case(gqa=gqa, bs=bs, lens=lens, share=[((0, 1, 2, 3), 3), ((4, 5), 2)])
    if layout == "consecutive":
        consecutive_prefix(case, (0, 1, 2, 3), 3, 1)  # overlaps other rows' pages: only equality matters here
    elif layout == "two runs":  # pages 1, 2, then the pool's last page (a block cached later, elsewhere)
        consecutive_prefix(case, (0, 1, 2, 3), 2, 1)
        table = case.block_tables.tolist()
        for r in (0, 1, 2, 3):
            table[r][2] = case.k_pages.shape[1] - 1
        case.block_tables = mx.array(table, dtype=mx.int32)
    tables, host_lens = case.block_tables.tolist(), case.context_lens.tolist()
    groups = find_prefix_groups(tables, host_lens, bs, min_group=2, min_shared_pages=1)
    assert sorted(g.rows for g in groups) == [(0, 1, 2, 3), (4, 5)]
    flat = paged_attention_reference(case.queries, case.k_pages, case.v_pages, case.block_tables,
                                     case.context_lens, scale=0.125)
    got = shared_prefix_attention(case.queries, case.k_pages, case.v_pages, case.block_tables, tables,
                                  host_lens, groups, scale=0.125)
    assert got.shape == flat.shape and got.dtype == flat.dtype
    assert max_abs_error(got, flat) < 1e-5
    only = shared_prefix_attention(case.queries, case.k_pages, case.v_pages, case.block_tables, tables,
                                   host_lens, [g for g in groups if g.rows == (4, 5)], scale=0.125)
    assert max_abs_error(only, flat) < 1e-5  # rows 0-3 in no group: every page is their own


def test_shared_pages_in_a_few_runs_are_views_in_order():
    """A shared prefix in a few runs of consecutive pages comes back as one view per run, in order (no gather);
    pages in more runs than MAX_SHARED_RUNS (or the null block) as one gathered piece; the rows equal the pages'."""
    from mlxkv.kernels.page_views_ref import MAX_SHARED_RUNS, _shared_rows

    kv_heads, pool, bs, d = 2, 40, 4, 8
    k_pages = mx.random.normal((kv_heads, pool, bs, d))
    v_pages = mx.random.normal((kv_heads, pool, bs, d))

    def expected(ids):
        idx = mx.array(ids, dtype=mx.int32)
        return [mx.take(p, idx, axis=1).reshape(kv_heads, len(ids) * bs, d) for p in (k_pages, v_pages)]

    scattered = list(range(1, 2 * MAX_SHARED_RUNS + 3, 2))  # MAX_SHARED_RUNS + 1 runs of one page
    for ids, pieces in (([3, 4, 5, 30], 2), ([7, 8], 1), (scattered, 1), ([0, 1], 1)):
        got = _shared_rows(k_pages, v_pages, ids)
        assert len(got) == pieces
        k = mx.concatenate([kp for kp, _ in got], axis=1)
        v = mx.concatenate([vp for _, vp in got], axis=1)
        want_k, want_v = expected(ids)
        assert mx.array_equal(k, want_k) and mx.array_equal(v, want_v)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("one_softmax", [True, False])
def test_runs_attention_equals_flat(gqa, dtype, one_softmax, monkeypatch):
    """One sequence whose visible rows lie in four runs of the stored rows (single pages, a run of two
    consecutive pages, a partial last page): equal to flat attention over the same pages, whether the decode
    step takes one softmax over the runs' scores (few scores) or merges a state per run."""
    from mlxkv.kernels import page_views_ref
    from mlxkv.kernels.page_views_ref import runs_attention

    calls = []
    real = page_views_ref._decode_one_softmax
    monkeypatch.setattr(page_views_ref, "_decode_one_softmax", lambda *a: calls.append(1) or real(*a))
    if not one_softmax:
        monkeypatch.setattr(page_views_ref, "ONE_SOFTMAX_MAX_SCORES", 0)

    bs, L = 16, 70  # 5 pages: table [3, 7, 8, 12, 20], the last holding 6 rows
    case = random_paged_case(dtype=dtype, head_dim=64, block_size=bs, kv_heads=2, gqa=gqa, context_lens=[L],
                             extra_blocks=20)
    table = [3, 7, 8, 12, 20]
    case.block_tables = mx.array([table + [0]], dtype=mx.int32)
    KVH, NB, _, D = case.k_pages.shape
    k_rows, v_rows = (p.reshape(1, KVH, NB * bs, D) for p in (case.k_pages, case.v_pages))
    runs = [(3 * bs, bs), (7 * bs, 2 * bs), (12 * bs, bs), (20 * bs, L - 4 * bs)]
    flat = paged_attention_reference(case.queries, case.k_pages, case.v_pages, case.block_tables,
                                     case.context_lens, scale=0.125)
    got = runs_attention(case.queries, k_rows, v_rows, runs, scale=0.125)
    assert got.shape == flat.shape and got.dtype == dtype
    assert max_abs_error(got, flat) <= TOLERANCES[dtype]
    assert bool(calls) == one_softmax


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("last_run", [2, 9])
def test_runs_attention_of_a_prefill_chunk_equals_causal_sdpa(gqa, dtype, last_run):
    """A 5-query chunk (the newest 5 of 70 rows) over four runs, causally: equal to dense causal SDPA over the
    same rows in order. ``last_run=2``: the last run starts after the chunk's first query (queries 0-2 see none of
    it: the all-masked state); ``9``: the chunk's rows span the last two runs."""
    from mlxkv.kernels.page_views_ref import runs_attention

    bs, L, n_q, KVH, D = 16, 70, 5, 2, 64
    NB = 32
    k_rows, v_rows = (mx.random.normal((1, KVH, NB * bs, D), key=mx.random.key(s)).astype(dtype) for s in (1, 2))
    queries = mx.random.normal((1, KVH * gqa, n_q, D), key=mx.random.key(3)).astype(dtype)
    lengths = [bs, 2 * bs, L - 3 * bs - last_run, last_run]  # rows per run, in position order
    firsts = [3 * bs, 7 * bs, 12 * bs + 4, 20 * bs]  # each run's first stored row
    runs = list(zip(firsts, lengths, strict=True))
    rows = mx.concatenate([mx.arange(f, f + n) for f, n in runs])  # (L,) the positions' stored rows
    keys, values = k_rows[:, :, rows], v_rows[:, :, rows]  # (1, KVH, L, D)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
    got = runs_attention(queries, k_rows, v_rows, runs, scale=0.125)
    assert got.shape == expected.shape and got.dtype == dtype
    assert max_abs_error(got, expected) <= TOLERANCES[dtype]


@pytest.mark.parametrize("rows", [2, 40])
def test_row_sums_equal_the_reduction_on_both_paths(rows):
    """Small states sum with MLX's reduction, large ones with a matmul against ones: the same sums, shape kept,
    rows of zeros (fully masked) still zero."""
    from mlxkv.kernels.page_views_ref import MATMUL_SUM_MIN_SCORES, _row_sums

    e = mx.random.uniform(shape=(2, rows, 1000), key=mx.random.key(0))
    e[:, 0] = 0.0
    assert (e.size >= MATMUL_SUM_MIN_SCORES) == (rows == 40)
    got, want = _row_sums(e), e.sum(axis=-1, keepdims=True)
    assert got.shape == want.shape == (2, rows, 1)
    assert mx.allclose(got, want, rtol=1e-5).item() and not mx.any(got[:, 0]).item()
