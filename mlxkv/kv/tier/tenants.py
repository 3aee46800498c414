"""Which tenant a cached block belongs to, for the secondary tier's per-tenant quota.

A tenant is a cache salt (requests without one share the unsalted tenant ``""``). Only a chain's first block
carries the salt among its extra keys (blocks.hashing.HashContext); the block pool gives every later block its
parent's salt as ``block.tenant`` when it caches it. In memory the tier names a tenant by a sha256 digest of the
salt; on disk only by a keyed tag of that digest (seal.Seal.tenant_tag), so a file never lets a salt be checked
offline.
"""

from __future__ import annotations

import hashlib

from mlxkv.kv.blocks.hashing import encode_key, salt_of

__all__ = ["UNSALTED", "salt_of", "tenant_digest"]

UNSALTED = ""  # the tenant of requests without a cache salt


def tenant_digest(salt) -> str:
    """The in-memory tenant id of ``salt`` (a block's ``tenant``; None: the unsalted tenant)."""
    if salt is None:
        return UNSALTED
    return hashlib.sha256(b"tenant\0" + encode_key((salt,))).hexdigest()
