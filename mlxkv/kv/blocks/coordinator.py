"""Prefix-hit search over one or more KV-cache groups (vLLM's hybrid coordinator, plus partial reuse).

A hit of ``L`` full blocks means: for every group, each block the group needs for a prefix of ``L*bs``
tokens (``spec.needed_blocks``) is cached with exactly our content. Content is checked, not trusted to the
hash: a candidate must carry our tokens and extra keys, and its parent ref must be the block matched just
before it (a chain of identities back to a first block), so a hash collision can never serve wrong K/V.
A sliding window cannot check the parent of the first block of its window (that block's predecessor may
be long evicted); instead each windowed block carries an anchor, the ref of the full-attention block at the
same index of the sequence that filled it, and must be anchored to a full-attention block this search
verified. In a model with no full-attention layer, the chained hash alone vouches for that one block.

Full-attention groups scan left to right (any prefix of a hit is a hit). Sliding/chunked groups scan right
to left from a candidate length and need only their window. Groups are intersected by a fixed-point loop:
the shortest hit wins and the windowed groups are searched again at that length until nothing changes.

Past the last full block, token-granular partial reuse looks for a cached block (full or partial) following
the last matched block whose tokens share the longest prefix with ours; every group must have one, and the
common length is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxkv.kv.blocks.block import BlockHash, KVCacheBlock
from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.kv.blocks.hashing import HashContext
from mlxkv.kv.blocks.specs import KVCacheGroupSpec


@dataclass(slots=True)
class PartialMatch:
    """A cached block whose first ``num_tokens`` tokens are the request's next tokens."""

    block: KVCacheBlock
    num_tokens: int


@dataclass(slots=True)
class PrefixHit:
    """Result of a prefix search; nothing is taken from the pool by finding it.

    blocks: per group, ``num_full_blocks`` blocks (the null block where the group needs none).
    partial: per group a PartialMatch with a common ``num_tokens``, or None.
    """

    block_size: int
    num_full_blocks: int
    blocks: list[list[KVCacheBlock]]
    partial: list[PartialMatch] | None = None

    @property
    def num_partial_tokens(self) -> int:
        return self.partial[0].num_tokens if self.partial else 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V the hit provides."""
        return self.num_full_blocks * self.block_size + self.num_partial_tokens


class _Search:
    """Memoized candidate lists for one request."""

    def __init__(self, pool: BlockPool, tokens: Sequence[int], hashes: Sequence[BlockHash], ctx: HashContext):
        self.pool, self.tokens, self.hashes, self.ctx = pool, tokens, hashes, ctx
        self.block_size = pool.block_size
        self._memo: dict[tuple[int, int], list[KVCacheBlock]] = {}

    def candidates(self, g: int, i: int) -> list[KVCacheBlock]:
        """Cached blocks of group g holding exactly our block i (tokens, extra keys; hash via lookup)."""
        key = (g, i)
        found = self._memo.get(key)
        if found is None:
            toks = tuple(self.tokens[i * self.block_size : (i + 1) * self.block_size])
            extra = self.ctx.block_extra_keys(i, self.block_size)
            found = [b for b in self.pool.lookup(g, self.hashes[i]) if b.token_ids == toks and b.extra_keys == extra]
            self._memo[key] = found
        return found

    def full(self, g: int, max_blocks: int) -> list[list[KVCacheBlock]]:
        """Left to right: per block index, the candidates linked to a candidate of the previous index."""
        sets: list[list[KVCacheBlock]] = []
        allowed = {None}  # the first block's parent is the root
        for i in range(max_blocks):
            valid = [c for c in self.candidates(g, i) if c.parent in allowed]
            if not valid:
                break
            sets.append(valid)
            allowed = {c.ref for c in valid}
        return sets

    def windowed(
        self, g: int, spec: KVCacheGroupSpec, max_blocks: int, anchors: list[set] | None
    ) -> tuple[int, dict[int, KVCacheBlock]]:
        """Right to left: the largest end <= max_blocks whose needed blocks form a linked cached chain.
        ``anchors[i]``: refs of the verified full-attention blocks at index i (None: no full group)."""
        end = max_blocks
        while end > 0:
            needed = spec.needed_blocks(end * self.block_size, self.block_size)
            if len(needed) == 0:
                return end, {}
            sets: dict[int, list[KVCacheBlock]] = {}
            allowed = None  # parent refs the block at index i must have (None: unconstrained)
            broken = None
            for i in reversed(needed):
                cands = self.candidates(g, i)
                if i == 0:
                    cands = [c for c in cands if c.parent is None]
                if anchors is not None:
                    cands = [c for c in cands if c.anchor in anchors[i]]
                linked = cands if allowed is None else [c for c in cands if c.ref in allowed]
                if not linked:
                    # no content at i: every end > i needs it. Content that does not link: start a chain at i.
                    broken = i + 1 if (cands and allowed is not None) else i
                    break
                sets[i] = linked
                allowed = {c.parent for c in linked}
            if broken is None:
                chain: dict[int, KVCacheBlock] = {}
                prev = None
                for i in needed:
                    prev = sets[i][0] if prev is None else next(c for c in sets[i] if c.parent == prev.ref)
                    chain[i] = prev
                return end, chain
            end = broken
        return 0, {}


class KVCacheCoordinator:
    """Finds the longest prefix hit across the groups of one pool."""

    def __init__(self, pool: BlockPool, specs: Sequence[KVCacheGroupSpec], enable_partial_reuse: bool = True):
        if not specs:
            raise ValueError("at least one KV-cache group spec is required")
        self.pool = pool
        self.specs = list(specs)
        self.enable_partial_reuse = enable_partial_reuse
        full = [g for g, spec in enumerate(self.specs) if spec.is_full]
        self.anchor_group: int | None = full[0] if full else None
        """Full-attention group whose blocks anchor the windowed groups' blocks (None: no full group)."""

    def find_prefix_hit(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash], ctx: HashContext, max_tokens: int
    ) -> PrefixHit:
        """Longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens (callers pass len - 1 so the
        last prompt token is always recomputed). ``hashes``: chained hashes of the full blocks of tokens."""
        bs = self.pool.block_size
        null = self.pool.null_block
        search = _Search(self.pool, tokens, hashes, ctx)
        length = min(len(hashes), max(0, max_tokens) // bs)
        full_sets: dict[int, list[list[KVCacheBlock]]] = {}
        for g, spec in enumerate(self.specs):
            if spec.is_full:
                full_sets[g] = search.full(g, length)
                length = min(length, len(full_sets[g]))
        anchors = None
        if self.anchor_group is not None and len(full_sets) < len(self.specs):
            anchors = [{c.ref for c in cands} for cands in full_sets[self.anchor_group]]
        windowed: dict[int, dict[int, KVCacheBlock]] = {}
        while True:  # fixed point: lengths only shrink
            before = length
            for g, spec in enumerate(self.specs):
                if not spec.is_full:
                    length, windowed[g] = search.windowed(g, spec, length, anchors)
            if length == before:
                break
        blocks: list[list[KVCacheBlock]] = []
        for g, spec in enumerate(self.specs):
            if spec.is_full:
                blocks.append(self._full_chain(full_sets[g], length))
            else:
                chain = windowed[g]
                blocks.append([chain.get(i, null) for i in range(length)])
        hit = PrefixHit(block_size=bs, num_full_blocks=length, blocks=blocks)
        if self.enable_partial_reuse and length * bs < min(max_tokens, len(tokens)):
            hit.partial = self._partial(tokens, ctx, hit, min(max_tokens, len(tokens)))
        return hit

    @staticmethod
    def _full_chain(sets: list[list[KVCacheBlock]], length: int) -> list[KVCacheBlock]:
        if length == 0:
            return []
        if all(len(s) == 1 for s in sets[:length]):  # the usual case: ``full`` linked each to the one before
            return [s[0] for s in sets[:length]]
        chain = [sets[length - 1][0]]
        for i in range(length - 2, -1, -1):
            parent = chain[-1].parent
            chain.append(next(c for c in sets[i] if c.ref == parent))
        chain.reverse()
        return chain

    def _partial(self, tokens, ctx: HashContext, hit: PrefixHit, limit: int) -> list[PartialMatch] | None:
        bs = self.pool.block_size
        j = hit.num_full_blocks
        want = tuple(tokens[j * bs : min(limit, (j + 1) * bs)])
        extra = ctx.block_extra_keys(j, bs)
        matches: list[PartialMatch] = []
        for g in range(len(self.specs)):
            if j == 0:
                parent = None
            else:
                prev = hit.blocks[g][j - 1]
                if prev.is_null:
                    return None  # the parent's identity is unknown here: no partial reuse
                parent = prev.ref
            best: PartialMatch | None = None
            for cand in self.pool.children(g, parent, extra, want[0]):
                n = _common_prefix(cand.token_ids, want)
                if best is None or n > best.num_tokens or (
                    n == best.num_tokens and cand.ref_cnt == 0 and best.block.ref_cnt > 0
                ):
                    best = PartialMatch(cand, n)
            if best is None or best.num_tokens == 0:
                return None
            matches.append(best)
        n = min(m.num_tokens for m in matches)
        for m in matches:
            m.num_tokens = n
        return matches


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
