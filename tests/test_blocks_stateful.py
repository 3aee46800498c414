"""Hypothesis stateful tests: random open/append/commit/fork/trim/free/preempt/resume/evict sequences.

A shadow storage layer plays the model: every slot the manager hands out is written with the value the real
K/V would have (a function of the salt and the whole prefix), copy instructions are applied as given, and
after every step every position of every running sequence must read back its own value. So a wrong prefix
hit, a cross-salt hit, a hash collision served, a bad copy or a write into a shared block all fail. The pool
invariants are checked too: free + used == total, each ref count equals the number of block tables holding
the block, nothing is both free and referenced.
"""

from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from mlxkv.kv.blocks.manager import KVCacheManager
from mlxkv.kv.blocks.specs import KVCacheGroupSpec

B = 4
BASES = ([0] * 8, [1, 2, 1, 2, 1, 2, 1, 2, 1], [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2])
token = st.integers(0, 2)
SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


class _Seq:
    def __init__(self, tokens, salt, allocated):
        self.tokens, self.salt, self.prompt_len = list(tokens), salt, len(tokens)
        self.allocated = self.committed = allocated


def alloc_count(s, n, new):
    """Tokens an allocate_slots call asked for (None: every pending prompt token)."""
    return len(new) if new is not None else (len(s.tokens) - s.allocated if n is None else n)


class BlockManagerMachine(RuleBasedStateMachine):
    GROUPS: ClassVar[list] = [KVCacheGroupSpec("full")]
    NUM_BLOCKS = 20
    KWARGS: ClassVar[dict] = {}

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(self.NUM_BLOCKS, B, self.GROUPS, event_capacity=64, **self.KWARGS)
        self.model = {}
        self.store = [{} for _ in self.GROUPS]
        self.history = []  # (tokens, salt) of sequences seen: later prompts extend them (multi-turn)

    # ---- the fake storage layer ------------------------------------------------------------------------
    def value(self, s, pos):
        return (s.salt, tuple(s.tokens[: pos + 1]))

    def apply_copies(self, copies):
        for c in copies:
            g = self.store[c.group_id]
            for k in range(c.num_tokens):
                g[c.dst_block * B + k] = g.get(c.src_block * B + k)

    def running(self):
        return list(self.model)

    def attached(self, sid, res):
        s = self.model[sid]
        s.allocated = s.committed = res.num_cached_tokens
        self.apply_copies(res.copies)

    # ---- rules ---------------------------------------------------------------------------------------------
    @initialize(target=seqs, base=st.sampled_from(BASES), salt=st.sampled_from([None, "s1"]))
    def seed(self, base, salt):
        """Start with one prefilled sequence so prefix hits are common."""
        sid = self.open(base, [], salt)
        self.prefill(sid)
        return sid

    @precondition(lambda self: len(self.model) < 6)
    @rule(target=seqs, base=st.sampled_from(BASES), suffix=st.lists(token, max_size=7),
          salt=st.sampled_from([None, None, "s1"]))
    def open(self, base, suffix, salt):
        tokens = base + suffix
        res = self.m.open(tokens, salt=salt)
        assert 0 <= res.num_cached_tokens <= len(tokens) - 1
        self.model[res.seq_id] = _Seq(tokens, salt, 0)
        self.attached(res.seq_id, res)
        return res.seq_id

    def _allocate(self, sid, n=None, new=None):
        """allocate_slots and "run the model": write each new slot's value. Returns the count allocated."""
        s = self.model[sid]
        if new is None:
            alloc = self.m.allocate_slots(sid, n)
        else:
            alloc = self.m.allocate_slots(sid, token_ids=new)
        if alloc is None:
            assert not self.m.can_allocate(sid, alloc_count(s, n, new))
            return 0
        assert alloc.start == s.allocated
        if new is not None:
            s.tokens.extend(new)
        self.apply_copies(alloc.copies)
        for g, slots in enumerate(alloc.slot_mapping):
            for p, slot in zip(range(alloc.start, alloc.start + alloc.num_tokens), slots):
                self.store[g][slot] = self.value(s, p)  # the model step writes K/V
        s.allocated += alloc.num_tokens
        return alloc.num_tokens

    def _commit(self, sid, k):
        self.m.commit(sid, k)
        self.model[sid].committed += k

    @rule(sid=seqs)
    def prefill(self, sid):
        """Allocate, write and commit every pending prompt token."""
        if sid in self.running():
            s = self.model[sid]
            if len(s.tokens) > s.allocated and self._allocate(sid, None):
                self._commit(sid, s.allocated - s.committed)

    @rule(sid=seqs, new=st.lists(token, min_size=1, max_size=5), accept=st.integers(0, 5))
    def decode(self, sid, new, accept):
        """Speculative round: feed tokens, accept some, trim the rest."""
        if sid in self.running():
            s = self.model[sid]
            if len(s.tokens) == s.allocated and self._allocate(sid, new=new):
                accept = min(accept, len(new))
                self._commit(sid, s.allocated - s.committed - (len(new) - accept))
                self.trim(sid, len(new) - accept)

    @rule(sid=seqs, data=st.data())
    def allocate(self, sid, data):
        """Fine-grained: a slice of the prompt, or new tokens, without committing."""
        if sid in self.running():
            s = self.model[sid]
            pending = len(s.tokens) - s.allocated
            if pending:
                self._allocate(sid, data.draw(st.integers(1, pending)))
            else:
                self._allocate(sid, new=data.draw(st.lists(token, min_size=1, max_size=5)))

    @rule(sid=seqs, data=st.data())
    def commit(self, sid, data):
        if sid in self.running():
            s = self.model[sid]
            self._commit(sid, data.draw(st.integers(0, s.allocated - s.committed)))

    @rule(sid=seqs, n=st.integers(0, 9))
    def trim(self, sid, n):
        if sid in self.running():
            s = self.model[sid]
            removed = self.m.trim(sid, n)
            assert 0 <= removed <= min(n, s.allocated)
            s.allocated -= removed
            s.committed = min(s.committed, s.allocated)
            del s.tokens[s.allocated:]

    @precondition(lambda self: len(self.model) < 6)
    @rule(target=seqs, sid=seqs)
    def fork(self, sid):
        if sid not in self.running():
            return sid
        (child,) = self.m.fork(sid)
        s = self.model[sid]
        c = _Seq(s.tokens, s.salt, s.allocated)
        c.prompt_len, c.committed = s.prompt_len, s.committed
        self.model[child] = c
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.model:
            s = self.model.pop(sid)
            self.history.append((s.tokens[: s.committed], s.salt))
            self.m.free(sid)

    @precondition(lambda self: len(self.model) < 6 and self.history)
    @rule(target=seqs, data=st.data(), suffix=st.lists(token, max_size=6),
          salt_flip=st.sampled_from([False, False, False, True]))
    def reopen(self, data, suffix, salt_flip):
        """A follow-up prompt: a past sequence's tokens (maybe cut) plus new ones, same or other salt."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.one_of(st.just(len(tokens)), st.integers(0, len(tokens))))
        if salt_flip:
            salt = None if salt else "s1"
        return self.open(tokens[:cut] or [0], suffix, salt)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        self.m.pool.evict_cached(n)

    # ---- invariants -------------------------------------------------------------------------------------
    @invariant()
    def pool_and_tables_consistent(self):
        self.m.check_invariants()
        pool = self.m.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
        assert len(self.m.events) <= 64

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        for sid, s in self.model.items():
            assert self.m.token_ids(sid) == s.tokens
            assert self.m.num_tokens(sid) == s.allocated and self.m.num_committed(sid) == s.committed
            for g, table in enumerate(self.m.block_tables(sid)):
                for p in range(s.allocated):
                    block = table[p // B]
                    if block:  # 0: released by a sliding/chunked group
                        got = self.store[g].get(block * B + p % B)
                        assert got == self.value(s, p), f"seq {sid} group {g} pos {p}: {got} != {self.value(s, p)}"


class HybridMachine(BlockManagerMachine):
    GROUPS: ClassVar[list] = [
        KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=6), KVCacheGroupSpec("chunked", chunk_size=8),
    ]
    NUM_BLOCKS = 64


class CollidingHashMachine(BlockManagerMachine):
    """Hashes ignore the parent, the salt and most tokens: collisions everywhere must still be harmless."""

    GROUPS: ClassVar[list] = [KVCacheGroupSpec("full"), KVCacheGroupSpec("sliding", window=5)]
    NUM_BLOCKS = 32
    KWARGS: ClassVar[dict] = {"hash_algo": lambda parent, tokens, extra: tokens[0] % 2}


class NoCopyLFUMachine(BlockManagerMachine):
    KWARGS: ClassVar[dict] = {"copy_on_partial_reuse": False, "eviction_policy": "lfu", "hash_algo": "builtin"}


TestFullAttention = BlockManagerMachine.TestCase
TestHybridGroups = HybridMachine.TestCase
TestCollidingHashes = CollidingHashMachine.TestCase
TestNoCopyLFU = NoCopyLFUMachine.TestCase
for _case in (TestFullAttention, TestHybridGroups, TestCollidingHashes, TestNoCopyLFU):
    _case.settings = SETTINGS
del _case
