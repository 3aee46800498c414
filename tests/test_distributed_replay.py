"""The leader's pool changes applied on a second pool give the same blocks, message by message (no mlx.launch).

A :class:`~mlxkv.distributed.leader.LeaderEngine` serves concurrent requests (shared prefixes, ``n=2`` forks, a
pool small enough to preempt) over a recording pool; its channel hands every message at once to a
:class:`~mlxkv.distributed.follower.Replayer` over a second pool of the same model, in the same process. After each
message the follower must hold exactly the leader's block tables, free blocks and cached blocks — what makes
every rank of a real launch read and write the same pages.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlxkv.config import KvCacheConfig
from mlxkv.distributed.follower import Replayer
from mlxkv.distributed.leader import LeaderEngine, Plans
from mlxkv.distributed.leader_pool import ChangeLog, LeaderPool
from mlxkv.distributed.steps import DecodeRun, StepMessage
from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CachePool
from mlxkv.models import load

SHARED = [(5 * i) % 700 + 20 for i in range(40)]
PROMPTS = [SHARED + [(11 * i + j) % 800 + 30 for i in range(9 + 5 * j)] for j in range(4)]


class _Watchdog:
    def start(self) -> "_Watchdog":
        return self

    def beat(self) -> None:
        pass

    def stop(self) -> None:
        pass


class _FollowerChannel:
    rank, size, is_leader = 1, 2, False
    watchdog = _Watchdog()

    def __init__(self) -> None:
        self.answers: list[list[bool]] = []  # its flags of each agreement step, read by rank 0's loopback

    def agree(self, flags: list[bool]) -> list[bool]:
        self.answers.append(list(flags))
        return flags  # rank 0 combines them (_LoopbackChannel.agree)

    @staticmethod
    def share(inputs, shape):
        import mlx.core as mx

        return mx.zeros(shape, dtype=mx.uint32)  # a real follower gets rank 0's tokens here; blocks do not depend on them


class _LoopbackChannel:
    """Rank 0's channel whose follower is in this process: each message is replayed and checked as it is sent."""

    rank, size, is_leader = 0, 2, True
    watchdog = _Watchdog()

    def __init__(self, replayer: Replayer):
        self.replayer = replayer
        self.sent = 0
        self.leader_pool = None
        self.kinds: list[str] = []  # every change and step sent, by type name
        self.changes: list = []  # every change sent
        self.steps: list = []  # every step sent

    @staticmethod
    def share(inputs, shape):
        return inputs

    @staticmethod
    def gather_memory():
        return []

    def agree(self, flags: list[bool]) -> list[bool]:
        """Rank 0's flags and the follower's (it answered while this step's message was replayed)."""
        theirs = self.replayer.channel.answers.pop()
        assert len(theirs) == len(flags)
        return [a and b for a, b in zip(flags, theirs)]

    def send(self, message: StepMessage) -> None:
        import pickle

        self.sent += 1
        message = pickle.loads(pickle.dumps(message))  # what a real channel carries
        follower = self.replayer
        for change in message.changes:
            self.changes.append(change)
            follower.apply(change)
            self.kinds.append(type(change).__name__)
        assert follower.pool.free_capacity() == message.free
        assert _tables(follower.pool) == _tables(self.leader_pool)
        assert follower.pool.block_stats()["kv_blocks"] == self.leader_pool.block_stats()["kv_blocks"]
        self.kinds.append(type(message.step).__name__)
        self.steps.append(message.step)
        # the rest of a follower's loop: the clock, then the step (a real channel gathers memory figures first)
        follower.receive(dataclasses.replace(message, changes=[], gather=False))


def _tables(pool: CachePool) -> dict:
    manager = pool.paged.manager
    return {s.id.value: manager.block_tables(s.paged.seq_id) for s in pool if s.paged is not None}


@pytest.fixture(scope="module")
def llama(test_model_dir):
    return load(str(test_model_dir("llama")), progress=False)


def test_applied_changes_keep_every_block_the_same(llama):
    kv = KvCacheConfig(backend="paged", block_size=8)
    config = EngineConfig(max_sequences=6, batched_prefill=True)
    leader_pool = CachePool(llama.model, max_sequences=6, backend="paged", kv_config=kv, num_blocks=24)
    follower_pool = CachePool(llama.model, max_sequences=6, backend="paged", kv_config=kv, num_blocks=24)
    channel = _LoopbackChannel(Replayer(llama.model, follower_pool, _FollowerChannel()))
    channel.leader_pool = leader_pool
    changes = ChangeLog()
    plans = Plans(channel, changes, leader_pool)
    pool = LeaderPool(leader_pool, changes, on_idle=plans.heartbeat, on_stop=plans.stop, heartbeat_s=1.0,
                      extra_stats=dict)
    engine = LeaderEngine(llama.model, None, config=config, pool=pool, context_length=4096, plans=plans).start()
    try:
        params = SamplingParams(max_tokens=24, temp=0.0)
        handles = [engine.submit(GenerationRequest(p, params, n=2 if i == 1 else 1)) for i, p in enumerate(PROMPTS)]
        for handle in handles:
            events = list(handle)
            assert events[-1].kind == "done", events[-1]
        again = list(engine.submit(GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=4, temp=0.0))))
        assert again[-1].kind == "done"
        # a prompt cached but for its last 5 tokens, arriving while another request decodes: it joins the batch
        running = iter(engine.submit(GenerationRequest(PROMPTS[3], SamplingParams(max_tokens=40, temp=0.0))))
        assert next(running).kind == "token"
        joined = list(engine.submit(GenerationRequest(SHARED + [77, 78, 79, 80, 81], params)))
        assert joined[-1].kind == "done" and list(running)[-1].kind == "done"
        stats = engine.stats()
    finally:
        engine.stop()
    assert "Stop" in channel.kinds  # the engine's last act tells the followers
    for kind in ("Open", "Fork", "Preempt", "Resume", "Feed", "FeedPlaceholder", "NameToken", "Reserve", "ReserveLast",
                 "Commit", "Release", "DecodeRun", "PrefillRun", "ProbeRun"):
        assert kind in channel.kinds, kind  # the workload went through every path it is meant to test
    assert stats["preemptions"] >= 1 and stats["prefix_cache"]["hits"] > 0
    assert any(isinstance(step, DecodeRun) and any(step.prompt_tails) for step in channel.steps)
    assert follower_pool.free_capacity() == leader_pool.free_capacity()
