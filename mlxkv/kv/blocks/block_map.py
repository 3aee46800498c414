"""A picture of the block pool for people: each block's state and owner, and the prefix tree of cached chains.

Built on the engine thread (the pool is not thread-safe) alongside the pool's figures, read by the HTTP routes
that draw the pool (``GET /v1/cache/blocks``, the built-in page, ``mlxkv top``), which filter it per viewer.

States, one character per allocatable block (block 1 first):

- ``f`` free: holds nothing an allocation would lose;
- ``c`` cached: free, but its content can still be revived by a prefix hit (evictable);
- ``u`` in use: held by a sequence, content not (yet) reusable;
- ``s`` shared: held by a sequence and findable in the prefix cache.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from mlxkv.kv.blocks.block_pool import BlockPool

#: The prefix tree lists at most this many cached blocks (the most hit first among siblings).
MAX_TREE_NODES = 512


def block_map(pool: BlockPool) -> dict[str, Any]:
    """The pool's blocks for display: ``states`` (a string, see above), ``owners`` (per block the tenant's
    index in ``tenants``, -1 when the block holds no cached content), ``tenants`` (the cache salts, None:
    unsalted; raw — the HTTP layer never shows them), ``priorities`` (effective retention priority of cached
    blocks, None otherwise) and ``tree`` (see :func:`prefix_tree`). O(blocks)."""
    now = pool.clock()
    tenants: list[Hashable] = []
    index: dict[Hashable, int] = {}
    states, owners, priorities = [], [], []
    for block in pool.blocks[1:]:
        held = block.ref_cnt > 0
        if block.cached:
            states.append("s" if held else "c")
            if block.tenant not in index:
                index[block.tenant] = len(tenants)
                tenants.append(block.tenant)
            owners.append(index[block.tenant])
            priorities.append(block.effective_priority(now))
        else:
            states.append("u" if held else "f")
            owners.append(-1)
            priorities.append(None)
    return {"states": "".join(states), "owners": owners, "tenants": tenants, "priorities": priorities,
            "tree": prefix_tree(pool, index)}


def prefix_tree(pool: BlockPool, tenant_index: dict[Hashable, int]) -> dict[str, Any]:
    """The cached chains as a forest: ``nodes`` in depth-first order, each ``{"block", "parent"`` (block id or
    None for a chain's first block), ``"depth", "tokens"`` (token ids), ``"hits", "held", "owner"}``, and
    ``truncated`` (cached blocks left out beyond :data:`MAX_TREE_NODES`). A block whose predecessor is no longer
    cached starts a chain of its own."""
    children: dict[int | None, list] = {}
    cached = [b for b in pool.blocks[1:] if b.cached]
    for block in cached:
        parent = pool.resolve(block.parent)
        children.setdefault(parent.block_id if parent is not None else None, []).append(block)
    nodes: list[dict] = []
    # a stack popped from its end: siblings pushed least hit first come out most hit first
    stack = [(b, None, 0) for b in sorted(children.get(None, ()), key=_rank)]
    while stack and len(nodes) < MAX_TREE_NODES:
        block, parent, depth = stack.pop()
        nodes.append({"block": block.block_id, "parent": parent, "depth": depth, "tokens": list(block.token_ids),
                      "hits": block.hit_count, "held": block.ref_cnt > 0, "owner": tenant_index[block.tenant]})
        for child in sorted(children.get(block.block_id, ()), key=_rank):
            stack.append((child, block.block_id, depth + 1))
    return {"nodes": nodes, "truncated": len(cached) - len(nodes)}


def _rank(block) -> tuple[int, int]:
    return block.hit_count, -block.block_id
