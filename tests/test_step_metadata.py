"""Per-step attention metadata of paged sequences (mlxkv/kv/paged/step_context.py): built once per step on the
host, before the model's forward, checked there (a bad table is refused before anything is written), and read by
every layer without a device read-back."""

import mlx.core as mx
import pytest
from testkit.archs import build_model

import mlxkv.kernels.dispatch as dispatch_module
import mlxkv.kv.batching.attention_backends as backends_module
from mlxkv.config import KvCacheConfig
from mlxkv.kv.batching import make_batch_views
from mlxkv.kv.batching.attention_backends import DecodePath
from mlxkv.kv.layouts import install_attention_hook
from mlxkv.kv.paged.step_context import BUILDS
from mlxkv.kv.store import CachePool

ROWS = 8


def open_rows(arch, prompts=None):
    """A paged pool with ROWS prefilled sequences (each fed its first decode token) and the model."""
    model, _ = build_model(arch)
    install_attention_hook(model)
    pool = CachePool(model, backend="paged", num_blocks=200, kv_config=KvCacheConfig(backend="paged", block_size=4))
    prompts = prompts or [[(5 * i + 11 * k) % 700 + 20 for i in range(9 + 3 * k)] for k in range(ROWS)]
    seqs = []
    for p in prompts:
        seq = pool.open(prompt=p)
        model(mx.array(p[seq.num_cached:])[None], cache=seq.caches)
        seq.commit()
        seq.feed([p[-1]])
        seqs.append(seq)
    return model, pool, seqs


class CountingModel:
    """The model, recording the metadata builds made while its forward runs (between its first and last layer)."""

    def __init__(self, model):
        self.model = model
        self.during = None

    def __call__(self, inputs, cache):
        before = dict(BUILDS)
        out = self.model(inputs, cache=cache)
        mx.eval(out)
        self.during = {k: BUILDS[k] - before.get(k, 0) for k in ("batch", "sequence")}
        return out


@pytest.mark.parametrize("arch, groups", [("llama", 1), ("gemma3_text", 2)])
def test_a_batched_decode_step_builds_its_metadata_once_per_group_before_the_forward(arch, groups, monkeypatch):
    """Eight rows, every layer: one BatchStep per manager group, all built by make_batch_views; none (and no
    sequence's) while the forward runs; the kernel gets host-checked tables (no device read-back)."""
    model, pool, seqs = open_rows(arch)
    monkeypatch.setattr(backends_module, "reference_on_views", lambda: False)  # the kernel path, every layer
    checks = []
    monkeypatch.setattr(dispatch_module, "check_table_contents", lambda *a: checks.append(a))
    calls = []
    real = backends_module.paged_attention
    monkeypatch.setattr(backends_module, "paged_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    batch_before = BUILDS["batch"]
    views = make_batch_views([s.caches for s in seqs])
    assert BUILDS["batch"] - batch_before == groups
    counting = CountingModel(model)
    counting(mx.array([[1]] * ROWS, dtype=mx.uint32), views)
    assert counting.during == {"batch": 0, "sequence": 0}
    layers = sum(1 for v in views if hasattr(v, "backend"))
    assert len(calls) == layers >= groups  # every layer attended through the kernel, on the metadata built once
    assert all(k["host_checked"] for k in calls) and not checks
    for seq in seqs:
        pool.release(seq.id)


def test_a_single_sequence_step_is_built_at_feed_not_by_its_layers():
    """One sequence decoding alone: feed builds the step's metadata; the layers only read it."""
    model, pool, seqs = open_rows("llama", prompts=[[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    seq = seqs[0]
    seq.commit()
    before = BUILDS["sequence"]
    seq.feed([7])
    assert BUILDS["sequence"] == before + 1
    counting = CountingModel(model)
    counting(mx.array([[7]], dtype=mx.uint32), seq.caches)
    assert counting.during["sequence"] == 0
    pool.release(seq.id)


def test_the_decode_path_is_chosen_once_per_step_for_the_group():
    """The backend of a group chooses its path when the step is built: on the reference path, rows sharing whole
    prefix pages attend to them once (a system prompt served by the prefix cache)."""
    shared = [(3 * i) % 500 + 10 for i in range(24)]
    model, pool, seqs = open_rows("llama", prompts=[shared + [100 + k, 200 + k] for k in range(4)])
    views = make_batch_views([s.caches for s in seqs])
    backends = {id(v.backend): v.backend for v in views if hasattr(v, "backend")}
    assert len(backends) == 1  # one backend for every layer of the group
    (backend,) = backends.values()
    assert backend.path is DecodePath.SHARED_PREFIX and backend.step.prefix_groups
    model(mx.array([[1]] * 4, dtype=mx.uint32), cache=views)
    for seq in seqs:
        pool.release(seq.id)


@pytest.mark.parametrize("bad", ["id-outside-pool", "context-longer-than-table"])
def test_bad_host_tables_are_refused_before_the_forward(bad, monkeypatch):
    """A block table that disagrees with the pool is refused where the step's metadata is built, on the host:
    nothing is written, the model is never called."""
    model, pool, seqs = open_rows("llama")
    manager = seqs[3].paged.manager
    real = manager.block_tables
    victim = seqs[3].paged.seq_id

    def corrupted(seq_id):
        tables = [list(t) for t in real(seq_id)]
        if seq_id == victim:
            if bad == "id-outside-pool":
                tables[0][0] = pool.paged.storage.num_blocks + 5
            else:
                tables[0] = tables[0][:1]  # a table too short for the sequence's context
        return tables

    monkeypatch.setattr(manager, "block_tables", corrupted)
    for seq in seqs:
        seq.paged._changed()  # the next step's metadata reads the tables again
    offsets = [s.caches[0].offset for s in seqs]
    with pytest.raises(ValueError, match="block_tables row|context_lens"):
        make_batch_views([s.caches for s in seqs])
    assert [s.caches[0].offset for s in seqs] == offsets
    if bad == "id-outside-pool":  # one sequence alone: refused when its step is built (feed, reserve, a layer)
        with pytest.raises(ValueError, match="block_tables row"):
            _ = seqs[3].paged.step
