"""The pool changes rank 0 sends under ``--distributed``: typed, applied by one function on every rank, and no pool
mutation reaches rank 0's pool without one (no mlx.launch: two pools of one model in this process).

The launches (tests/test_distributed*.py with ``mlx.launch``) show the outcome — the same tokens as one process;
these tests pin the mechanism: the recorded list is exactly what rank 0 applied, a second pool applying it holds the
same blocks, a follower whose pool answers otherwise stops, and a pool method without a change type is caught.
"""

from __future__ import annotations

import inspect
import pickle
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.distributed import changes as ch
from mlxkv.distributed.follower import Replayer
from mlxkv.distributed.leader_pool import POOL_READS, SEQUENCE_READS, ChangeLog, LeaderPool, LeaderSequence
from mlxkv.distributed.steps import ChunkRun, DecodeRun, PrefillRun, ProbeRun, StepMessage, Stop, describe
from mlxkv.engine.plan import PrefillChunk, StepPlan
from mlxkv.kv import CacheRequest, CachePool, Sequence
from mlxkv.models import load

PROMPT = [(3 * i) % 300 + 20 for i in range(21)]


def _public_methods(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, n))}


def test_every_pool_method_is_a_change_or_a_declared_read():
    """A mutating method added to CachePool or Sequence fails here until it has a change type (or is declared a
    read); each one is defined on rank 0's facade by name, which forwards nothing it does not define."""
    assert _public_methods(CachePool) == set(ch.POOL_CHANGES) | set(POOL_READS)
    assert _public_methods(Sequence) == set(ch.SEQUENCE_CHANGES) | set(SEQUENCE_READS)
    assert not set(ch.POOL_CHANGES) & set(POOL_READS) and not set(ch.SEQUENCE_CHANGES) & set(SEQUENCE_READS)
    for facade, names in ((LeaderPool, _public_methods(CachePool)), (LeaderSequence, _public_methods(Sequence))):
        assert names <= set(vars(facade)), names - set(vars(facade))
        assert "__getattr__" not in vars(facade) and "__getattribute__" not in vars(facade)


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def _pool(model) -> CachePool:
    return CachePool(model, max_sequences=4, backend="paged", kv_config=KvCacheConfig(backend="paged", block_size=4),
                     num_blocks=24)


def _tables(pool: CachePool) -> dict:
    manager = pool.paged.manager
    return {s.id.value: manager.block_tables(s.paged.seq_id) for s in pool if s.paged is not None}


def _write(seq, tokens: list[int], model) -> None:
    """``tokens`` through ``model`` into ``seq``'s caches (as a forward between a reserve and its commit)."""
    mx.eval(model(mx.array(tokens, dtype=mx.uint32)[None], cache=seq.caches))


def test_the_recorded_changes_are_what_rank_0_applied(llama):
    """Each facade call records one typed change, as applied (with the ids rank 0's pool gave); a second pool
    applying the pickled list through :func:`apply_change` holds the same block tables and free blocks."""
    model = llama.model
    log = ChangeLog()
    own = _pool(model)
    leader = LeaderPool(own, log, on_idle=lambda: None, on_stop=lambda t: None, heartbeat_s=1.0,
                        extra_stats=dict)
    follower = _pool(model)
    seq = leader.open(len(PROMPT), prompt=PROMPT, cache_request=CacheRequest(salt="a"))
    seq.reserve(0, len(PROMPT) - 1)
    _write(seq, PROMPT[:-1], model)
    seq.commit()
    children = leader.fork(seq.id, 2)
    for s in (seq, *children):  # each first decode step writes the prompt's last token
        s.reserve_last()
        s.commit()
    position = children[0].feed_placeholder()
    children[0].name_token(position, 7)
    children[1].feed([9])
    leader.preempt(children[1].id)
    leader.resume(children[1].id, PROMPT + [9])
    leader.release(seq.id)
    leader.evict_cached("b")
    sent = pickle.loads(pickle.dumps(log.take()))  # what the channel carries
    assert [type(c).__name__ for c in sent] == ["Open", "Reserve", "Commit", "Fork", *["ReserveLast", "Commit"] * 3,
                                                "FeedPlaceholder", "NameToken", "Feed", "Preempt", "Resume", "Release",
                                                "EvictCached"]
    assert sent[0] == ch.Open(len(PROMPT), PROMPT, CacheRequest(salt="a"), opened=seq.id.value)
    assert sent[3].children == tuple(c.id.value for c in children)
    assert sent[11] == ch.NameToken(children[0].id.value, position, 7)
    results = [ch.apply_change(follower, change) for change in sent]
    assert _tables(follower) == _tables(own)
    assert follower.free_capacity() == leader.free_capacity()
    assert results[10] == position  # the same placeholder position on both ranks
    assert not log.pending


def test_a_follower_whose_pool_answers_otherwise_stops(llama):
    model = llama.model
    follower = _pool(model)
    follower.open(len(PROMPT), prompt=PROMPT)  # an open rank 0 never made: the next id differs
    with pytest.raises(ch.Diverged, match="opened sequence id 2 differs from rank 0's 1"):
        ch.apply_change(follower, ch.Open(len(PROMPT), PROMPT, None, opened=1))
    with pytest.raises(TypeError, match="not a KV pool change"):
        ch.apply_change(follower, ("seq", "feed", 1, ([5],)))  # an untyped call is not a change
    with pytest.raises(RuntimeError, match="this rank has no tier"):
        ch.apply_change(follower, ch.TierRestore(PROMPT, (None, None, ()), 0, 5, [(0, 0, 0)], 1))


def test_a_follower_stops_on_what_it_does_not_know(llama):
    """An unknown change or step from rank 0 is an error the follower stops on (serve_follower ends the launch),
    not a failed forward it would log and go past."""
    from test_distributed_replay import _FollowerChannel

    pool = _pool(llama.model)
    replayer = Replayer(llama.model, pool, _FollowerChannel())
    for step in (("forward", [1], (1, 1), True), ProbeRun("sideways")):
        with pytest.raises(TypeError, match="unknown step"):
            replayer.receive(StepMessage(free=pool.free_capacity(), step=step))
    with pytest.raises(TypeError, match="not a KV pool change"):
        replayer.receive(StepMessage(changes=[("release", 1)], free=pool.free_capacity()))
    assert replayer.receive(StepMessage(free=pool.free_capacity(), now=5.0))  # an idle heartbeat: the clock moves
    assert replayer.clock.now == 5.0 and not replayer.receive(StepMessage(free=pool.free_capacity(), step=Stop(2.0)))
    assert replayer.flush_timeout == 2.0


def test_a_change_made_behind_the_facade_stops_the_follower_at_the_next_message(llama):
    """What reaches rank 0's pool without a change (here a slot taken on the pool itself, as a layer cache's own trim
    would) shows in the sequences every message carries: the follower stops instead of drifting."""
    from test_distributed_replay import _FollowerChannel

    model = llama.model
    own, log = _pool(model), ChangeLog()
    leader = LeaderPool(own, log, on_idle=lambda: None, on_stop=lambda t: None, heartbeat_s=1.0, extra_stats=dict)
    replayer = Replayer(model, _pool(model), _FollowerChannel())

    def message() -> StepMessage:
        return StepMessage(log.take(), free=own.free_capacity(), sequences=ch.sequence_state(own))

    seq = leader.open(len(PROMPT), prompt=PROMPT)
    seq.reserve(0, 18)
    assert replayer.receive(message())
    own.get(seq.id).reserve(18, 19)  # behind the facade, inside a block already held: no change, same free blocks
    assert own.free_capacity() == replayer.pool.free_capacity()
    with pytest.raises(ch.Diverged, match=r"\(id, slots, committed\) \[\(1, 18, 0\)\], rank 0's \[\(1, 19, 0\)\]"):
        replayer.receive(message())


def test_a_method_added_to_the_pool_is_not_reachable_through_rank_0s_facade(llama):
    inner = CachePool(llama.model, max_sequences=2)
    leader = LeaderPool(inner, ChangeLog(), on_idle=lambda: None, on_stop=lambda t: None, heartbeat_s=1.0,
                        extra_stats=dict)
    inner.shrink = lambda: None  # as if the pool gained a mutating method
    with pytest.raises(AttributeError, match="shrink"):
        leader.shrink()
    seq = leader.open(3, prompt=[1, 2, 3])
    seq._seq.snapshot = lambda: None
    with pytest.raises(AttributeError, match="snapshot"):
        seq.snapshot()
    assert seq.nbytes() >= 0 and leader.free_capacity() >= 0  # declared reads pass through


def _chunk(seq_id: int, tokens: list[int], start: int, end: int, want_logits: bool, media=()) -> PrefillChunk:
    task = SimpleNamespace(tokens=tokens, seq=SimpleNamespace(id=SimpleNamespace(value=seq_id)),
                           job=SimpleNamespace(request=SimpleNamespace(media=list(media))))
    return PrefillChunk(task, start, end, want_logits)


def test_the_step_sent_describes_the_plans_forward():
    tokens = list(range(10, 30))
    plan = StepPlan(prefills=[_chunk(1, tokens, 4, 12, False), _chunk(2, tokens, 0, 3, True)], together=True)
    assert describe(plan, batched=True) == PrefillRun([ChunkRun(1, tokens[4:12], False), ChunkRun(2, tokens[:3], True)],
                                                      together=True)
    one = StepPlan(prefills=[_chunk(3, tokens, 0, 5, False)])
    assert describe(one, batched=True, always_logits=True) == PrefillRun([ChunkRun(3, tokens[:5], True)], False)
    rows = [SimpleNamespace(seq=SimpleNamespace(id=SimpleNamespace(value=v))) for v in (4, 6)]
    decode = StepPlan(decode=rows, decode_inputs=mx.zeros((2, 1), dtype=mx.uint32))
    assert describe(decode, batched=False) == DecodeRun([4, 6], (2, 1), False)
    assert describe(StepPlan(started=[object()]), batched=True) is None  # nothing runs: nothing is sent
    with pytest.raises(ValueError, match="speculative decoding"):
        describe(StepPlan(decode=rows, drafts=[[1], []]), batched=True)
    image = SimpleNamespace(start=2, end=5)
    with pytest.raises(ValueError, match="images"):
        describe(StepPlan(prefills=[_chunk(1, tokens, 0, 8, True, [image])]), batched=True)
