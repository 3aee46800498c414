"""The block pool's picture (mlxkv/kv/blocks/block_map.py) and what each viewer sees of it (cache_view.py), on a
small pool built by hand: states, owners, the prefix tree's order and hits, and the per-viewer filter."""

from __future__ import annotations

from mlxkv.kv.blocks import block_map as block_map_module
from mlxkv.kv.blocks.block_map import block_map
from mlxkv.kv.blocks.block_pool import BlockPool
from mlxkv.server.cache_view import OTHERS, UNSALTED, tenant_label, viewer_view


def cached_chain(pool: BlockPool, salt: str | None, first_token: int, length: int):
    """``length`` held blocks cached as one chain of ``salt``'s (each block's tokens: ``first_token + i`` repeated)."""
    blocks = pool.get_new_blocks(length)
    parent = None
    for i, block in enumerate(blocks):
        extra = (("s", salt),) if salt is not None and parent is None else ()
        pool.cache_full_block(block, group_id=0, block_hash=("h", salt, first_token + i), parent_hash=None,
                              parent_ref=parent, token_ids=(first_token + i,) * pool.block_size, extra_keys=extra)
        parent = (block.block_id, block.generation)
    return blocks


def pool_with_two_tenants() -> tuple[BlockPool, list, list, list]:
    pool = BlockPool(12, 4)
    alice = cached_chain(pool, "alice", 10, 3)
    bob = cached_chain(pool, "bob", 20, 2)
    held = pool.get_new_blocks(1)  # in use, nothing cached
    pool.free_blocks(alice)  # alice's chain is idle (evictable), bob's still held
    pool.touch(alice[:2])  # a prefix hit on alice's first two blocks ...
    pool.free_blocks(alice[:2])  # ... by a request that has finished
    return pool, alice, bob, held


def test_states_owners_and_the_tree():
    pool, alice, bob, held = pool_with_two_tenants()
    raw = block_map(pool)
    assert raw["states"] == "cccssu" + "f" * 5
    assert raw["tenants"] == ["alice", "bob"] and raw["owners"][:6] == [0, 0, 0, 1, 1, -1]
    assert raw["priorities"][:5] == [35] * 5 and raw["priorities"][5:] == [None] * 6
    nodes = raw["tree"]["nodes"]
    # depth first, the most hit chain first: alice's (hit once) before bob's
    assert [(n["block"], n["parent"], n["depth"], n["hits"]) for n in nodes] == [
        (alice[0].block_id, None, 0, 1), (alice[1].block_id, alice[0].block_id, 1, 1),
        (alice[2].block_id, alice[1].block_id, 2, 0), (bob[0].block_id, None, 0, 0),
        (bob[1].block_id, bob[0].block_id, 1, 0)]
    assert nodes[0]["tokens"] == [10] * 4 and not nodes[0]["held"] and nodes[3]["held"]
    assert raw["tree"]["truncated"] == 0


def test_the_tree_is_bounded(monkeypatch):
    pool, *_ = pool_with_two_tenants()
    monkeypatch.setattr(block_map_module, "MAX_TREE_NODES", 2)
    tree = block_map(pool)["tree"]
    assert len(tree["nodes"]) == 2 and tree["truncated"] == 3


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_a_tenant_sees_its_blocks_and_only_others_of_the_rest():
    pool, alice, bob, _ = pool_with_two_tenants()
    view = viewer_view(block_map(pool), sees_all=False, scope="alice", decode=decode)
    assert view["view"] == "tenant" and view["states"] == "cccssu" + "f" * 5
    assert view["tenants"] == [{"label": tenant_label("alice"), "own": True}, {"label": OTHERS, "own": False}]
    assert view["owners"][:6] == [0, 0, 0, 1, 1, -1]
    assert view["priorities"][:6] == [35, 35, 35, None, None, None]
    assert [n["block"] for n in view["tree"]["nodes"]] == [b.block_id for b in alice]
    assert view["tree"]["nodes"][0]["text"] == "10 10 10 10" and view["tree"]["nodes"][0]["tokens"] == 4
    assert "alice" not in repr(view) and "bob" not in repr(view)  # salts are never shown
    nobody = viewer_view(block_map(pool), sees_all=False, scope=None, decode=decode)
    assert nobody["tenants"] == [{"label": OTHERS, "own": False}] and nobody["tree"]["nodes"] == []


def test_the_whole_cache_viewer_sees_every_tenant_by_fingerprint():
    pool, alice, bob, _ = pool_with_two_tenants()
    cached_chain(pool, None, 30, 1)
    view = viewer_view(block_map(pool), sees_all=True, scope=None, decode=decode)
    assert [t["label"] for t in view["tenants"]] == [tenant_label("alice"), tenant_label("bob"), UNSALTED]
    assert [t["own"] for t in view["tenants"]] == [False, False, True]
    assert len(view["tree"]["nodes"]) == 6 and all(p is not None for p in view["priorities"][:5])
    assert "alice" not in repr(view) and tenant_label("alice") != tenant_label("bob")
