"""Free blocks in eviction order: doubly linked lists whose links live on the blocks themselves.

``FreeBlockQueue`` is one list with sentinel head and tail: append, appendleft, popleft and remove (a cache
hit on a free block) are O(1) and allocate nothing. ``BucketedFreeQueue`` keeps one such list per bucket (the
eviction policy's sort key, e.g. a retention priority); the victim is the head of the lowest non-empty
bucket, so eviction order is (bucket, order of arrival in the bucket).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from mlxkv.kv.blocks.block import KVCacheBlock

UNCACHED_BUCKET = -1
"""Bucket of free blocks holding no cached content: always reused before any cached block is evicted."""


class FreeBlockQueue:
    """One doubly linked list of free blocks; the head is evicted first."""

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def peek(self) -> KVCacheBlock | None:
        """The head block, or None when empty."""
        return None if self._len == 0 else self._head.next_free

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already linked"
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (evicted last)."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the head (evicted next)."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in a free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block."""
        assert self._len > 0, "popleft from an empty free queue"
        block = self._head.next_free
        self.remove(block)
        return block


class BucketedFreeQueue:
    """Free blocks ordered by (bucket, stamp); ``popleft`` takes the lowest bucket's head."""

    __slots__ = ("_front_stamp", "_keys", "_len", "_next_stamp", "_queues")

    def __init__(self) -> None:
        self._queues: dict[int, FreeBlockQueue] = {}
        self._keys: list[int] = []  # sorted buckets with at least one block
        self._len = 0
        self._next_stamp = 0  # stamps for tail appends grow upward ...
        self._front_stamp = 0  # ... and for head inserts downward, so stamp order is queue order

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Every free block, in eviction order."""
        for key in list(self._keys):
            yield from self._queues[key]

    def cached_blocks(self) -> Iterator[KVCacheBlock]:
        """The free blocks holding cached content (every bucket but UNCACHED_BUCKET), in eviction order."""
        for key in list(self._keys):
            if key != UNCACHED_BUCKET:
                yield from self._queues[key]

    def count(self, bucket: int) -> int:
        """Number of free blocks in ``bucket``."""
        queue = self._queues.get(bucket)
        return 0 if queue is None else len(queue)

    def bucket_sizes(self) -> dict[int, int]:
        """Number of free blocks per bucket."""
        return {key: len(self._queues[key]) for key in self._keys}

    def push(self, block: KVCacheBlock, bucket: int, front: bool = False) -> None:
        """Add a block to ``bucket``: at its tail (evicted last in the bucket) or, with ``front``, its head."""
        assert block.free_bucket is None, f"{block} is already free"
        queue = self._queues.get(bucket)
        if queue is None:
            queue = self._queues[bucket] = FreeBlockQueue()
        if len(queue) == 0:
            bisect.insort(self._keys, bucket)
        if front:
            self._front_stamp -= 1
            block.free_stamp = self._front_stamp
            queue.appendleft(block)
        else:
            self._next_stamp += 1
            block.free_stamp = self._next_stamp
            queue.append(block)
        block.free_bucket = bucket
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Take a block out of the queue (a cache hit on a free block, or a re-bucketing)."""
        bucket = block.free_bucket
        assert bucket is not None, f"{block} is not free"
        queue = self._queues[bucket]
        queue.remove(block)
        if len(queue) == 0:
            self._keys.pop(bisect.bisect_left(self._keys, bucket))
        block.free_bucket = None
        self._len -= 1

    def peek(self) -> KVCacheBlock | None:
        """The next victim, or None when empty."""
        return self._queues[self._keys[0]].peek() if self._keys else None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the next victim."""
        block = self.peek()
        assert block is not None, "popleft from an empty free queue"
        self.remove(block)
        return block
