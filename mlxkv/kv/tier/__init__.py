"""Secondary KV tier: blocks evicted from the primary pool kept in host memory and/or on disk.

- fingerprint.py: model identity (architecture + weights identity) so files never cross models;
- format.py: ``TierBlock`` and the verified one-file-per-block disk format;
- store.py: ``HostMemoryStore`` / ``DiskStore`` (byte caps, priority-LRU, atomic writes, index by scan);
- tier.py: ``SecondaryTier`` (priority threshold, memory → disk cascade, counters);
- paged.py: ``TierBridge`` (evict → offload, hit → restore for a paged backend; imports MLX).
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
from mlxkv.kv.tier.secondary import SecondaryTier

__all__ = ["FORMAT_VERSION", "DiskStore", "FormatError", "HostMemoryStore", "SecondaryTier", "TierBlock",
           "decode_block", "encode_block", "fingerprint_folder", "fingerprint_model", "make_fingerprint"]
