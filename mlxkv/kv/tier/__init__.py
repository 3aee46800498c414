"""Secondary KV tier: blocks evicted from the primary pool kept in host memory and/or on disk.

- fingerprint.py: model identity (architecture + weights identity) so files never cross models;
- seal.py: the per-installation secret beside a tier folder, the AES-GCM sealing and HMAC-SHA256 tags made with it;
- header.py: a file header's bounded, typed parsing (no file can crash or stall its reader);
- format.py: ``TierBlock`` and the verified one-file-per-block disk format;
- host_store.py / disk_store.py: ``HostMemoryStore`` / ``DiskStore`` (byte caps, priority-LRU, atomic private
  writes, index by scan);
- tenants.py / quota.py: a block's tenant (its chain's cache salt) and the per-tenant quota of a store;
- listing.py: a folder's verified content for ``mlxkv cache ls`` (cycles and duplicates counted once);
- secondary.py: ``SecondaryTier`` (priority threshold, memory → disk cascade, counters);
- read_ahead.py: disk blocks a restore will take, read on a thread of their own;
- prefix_lookup.py: ``PrefixLookup``, a prompt's hit across pool and tier, made once and carried to the open;
- restore_plan.py: which tier blocks a restore brings back, for every layout;
- bridge.py: ``TierBridge`` (evict → offload, lookup → read ahead → restore for a paged backend; imports MLX).
"""

from mlxkv.kv.tier.disk_store import DiskStore
from mlxkv.kv.tier.fingerprint import (
           fingerprint_folder,
           fingerprint_model,
           make_fingerprint,
)
from mlxkv.kv.tier.format import (
           FORMAT_VERSION,
           FormatError,
           TierBlock,
           decode_block,
           encode_block,
)
from mlxkv.kv.tier.host_store import HostMemoryStore
from mlxkv.kv.tier.seal import Seal, SecretError, open_seal, secret_path
from mlxkv.kv.tier.secondary import SecondaryTier

__all__ = ["FORMAT_VERSION", "DiskStore", "FormatError", "HostMemoryStore", "Seal", "SecondaryTier", "SecretError",
           "TierBlock", "decode_block", "encode_block", "fingerprint_folder", "fingerprint_model", "make_fingerprint",
           "open_seal", "secret_path"]
