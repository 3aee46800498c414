"""Which tenant a cached block belongs to, for the secondary tier's per-tenant quota.

A tenant is a cache salt (requests without one share the unsalted tenant ``""``). Only a chain's first block
carries the salt among its extra keys (blocks.hashing.HashContext); later blocks inherit it through the chain,
so :func:`chain_tenant` walks parent refs to the first block. In memory a tenant is a sha256 digest of the salt;
on disk only a keyed tag of that digest (seal.Seal.tenant_tag), so a file never lets a salt be checked offline.
"""

from __future__ import annotations

import hashlib

from mlxkv.kv.blocks.hashing import encode_key, salt_of

__all__ = ["MAX_WALK", "UNSALTED", "chain_tenant", "salt_of", "tenant_digest"]

UNSALTED = ""  # the tenant of requests without a cache salt
MAX_WALK = 1 << 16  # chain length bound (a corrupt parent link can never loop)


def tenant_digest(salt) -> str:
    """The in-memory tenant id of ``salt`` (None: the unsalted tenant)."""
    if salt is None:
        return UNSALTED
    return hashlib.sha256(b"tenant\0" + encode_key((salt,))).hexdigest()


def chain_tenant(pool, block) -> str | None:
    """The tenant of a cached ``block`` of ``pool`` (a BlockPool: ``resolve``): its chain's first block's salt;
    None when the chain is broken before its first block (an ancestor already evicted)."""
    b = block
    for _ in range(MAX_WALK):
        if b.parent is None:
            return tenant_digest(salt_of(b.extra_keys))
        b = pool.resolve(b.parent)
        if b is None:
            return None
    return None

