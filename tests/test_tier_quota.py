"""Fair sharing of the disk tier: a per-tenant (cache salt) quota, so one tenant at retention priority 100
cannot keep every other tenant's blocks out; tenants follow the salt along a chain and survive a restart."""

from __future__ import annotations

from test_tier_paged import B, OTHER, PROMPT, backend, run
from test_tier_store import FP, make_block

from mlxkv.kv.tier import DiskStore, SecondaryTier, fingerprint_model
from mlxkv.kv.tier.bridge import TierBridge
from mlxkv.kv.tier.format import encode_block
from mlxkv.kv.tier.tenants import tenant_digest

A, B_TENANT = tenant_digest("tenant-a"), tenant_digest("tenant-b")


def blocks_of(tenant, first, n, priority):
    out = []
    for i in range(first, first + n):
        b = make_block(i, priority=priority)
        b.parent_hash, b.tenant = None, tenant  # separate one-block chains
        out.append(b)
    return out


def test_a_priority_100_tenant_cannot_keep_the_next_one_out(tmp_path):
    probe = DiskStore(tmp_path / "probe", FP, 1 << 20)
    size = max(len(encode_block(b, FP, probe.seal)) for b in blocks_of(A, 100, 30, 100))
    cap = 10 * size
    tier = SecondaryTier(35, disk=DiskStore(tmp_path / "tier", FP, cap, tenant_quota_bytes=cap // 2))
    disk = tier.disk
    tag_a, tag_b = disk.seal.tenant_tag(A), disk.seal.tenant_tag(B_TENANT)
    for b in blocks_of(A, 100, 10, priority=100):  # alone, tenant A may fill the whole tier
        assert tier.offload(b)
    assert len(disk) == 10 and disk.by_tenant() == {tag_a: disk.nbytes}
    stored_b = [tier.offload(b) for b in blocks_of(B_TENANT, 200, 8, priority=35)]
    assert all(stored_b)  # every one of the next tenant's blocks is stored, at priority 35 against 100
    held = disk.by_tenant()
    assert held[tag_a] <= cap // 2 and held[tag_b] <= cap // 2 + size and disk.nbytes <= cap
    b_keys = {k for k in disk.keys() if disk._lru.tenant(k) == tag_b}
    assert len(b_keys) >= 4
    for b in blocks_of(A, 300, 10, priority=100):  # A at its quota: it now pushes out only its own blocks
        tier.offload(b)
    assert {k for k in disk.keys() if disk._lru.tenant(k) == tag_b} == b_keys
    assert disk.by_tenant()[tag_a] <= cap // 2
    restarted = DiskStore(tmp_path / "tier", FP, cap, tenant_quota_bytes=cap // 2)  # tenants are in the files
    assert restarted.by_tenant() == disk.by_tenant()


def test_without_a_quota_the_squatter_wins(tmp_path):
    probe = DiskStore(tmp_path / "probe", FP, 1 << 20)
    cap = 10 * max(len(encode_block(b, FP, probe.seal)) for b in blocks_of(A, 100, 30, 100))
    tier = SecondaryTier(35, disk=DiskStore(tmp_path / "tier", FP, cap))
    for b in blocks_of(A, 100, 10, priority=100):
        tier.offload(b)
    assert not any(tier.offload(b) for b in blocks_of(B_TENANT, 200, 8, priority=35))
    assert tier.counters.dropped_no_room == 8


def test_evicted_blocks_carry_their_chains_salt(model, tmp_path):
    be = backend(model)
    disk = DiskStore(tmp_path, fingerprint_model(model), 1 << 20, block_size=B)
    bridge = TierBridge(be, SecondaryTier(35, disk=disk))
    run(be, bridge, PROMPT, salt="tenant-a")
    run(be, bridge, PROMPT, salt="tenant-b")
    run(be, bridge, OTHER)  # evicts both salted chains to disk
    held = disk.by_tenant()
    tag = disk.seal.tenant_tag
    assert set(held) >= {tag(A), tag(B_TENANT)}
    count = {t: sum(disk._lru.tenant(k) == t for k in disk.keys()) for t in held}
    assert count[tag(A)] == count[tag(B_TENANT)] == 5  # every block of each chain, not only the first
    for path in tmp_path.iterdir():
        assert A.encode() not in path.read_bytes() and B_TENANT.encode() not in path.read_bytes()
