"""The disk tier's read-ahead: blocks a restore will take are read on a thread of their own and staged in host
memory; ``request`` says whether they are all there, ``take`` hands each over once, a byte cap bounds the staging."""

from __future__ import annotations

import threading

from mlxkv.kv.tier.read_ahead import ReadAhead


class Block:
    """What ReadAhead needs of a TierBlock: its size."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_reads_happen_off_the_caller_and_are_taken_once():
    gate = threading.Event()
    reads: list = []

    def read(key):
        gate.wait(5)
        reads.append((key, threading.current_thread().name))
        return Block(100) if key != (0, b"gone") else None

    ahead = ReadAhead(read)
    keys = [(0, b"a"), (0, b"b"), (0, b"gone")]
    assert ahead.request(keys) is False  # submitted: the caller does not wait
    assert ahead.pending(keys) and ahead.request(keys) is False  # asked again: nothing read twice
    gate.set()
    while ahead.pending(keys):
        ahead.wait(1)
    assert ahead.request(keys) is True  # all staged now (the missing one is left to the restore)
    assert sorted(k for k, _ in reads) == sorted(keys)
    assert all(name.startswith("mlxkv-tier-read") for _, name in reads)
    assert ahead.blocks_read == 2 and ahead.blocks_missing == 1 and ahead.staged_bytes == 200
    assert ahead.take((0, b"a")).nbytes == 100 and ahead.take((0, b"a")) is None
    assert ahead.staged_bytes == 100
    ahead.clear()
    assert ahead.take((0, b"b")) is None and ahead.staged_bytes == 0
    ahead.close()


def test_the_byte_cap_leaves_the_rest_to_the_restore():
    ahead = ReadAhead(lambda key: Block(60), max_bytes=100)
    keys = [(0, bytes([i])) for i in range(3)]
    ahead.request(keys)
    while ahead.pending(keys):
        ahead.wait(1)
    assert ahead.blocks_read == 1 and ahead.staged_bytes == 60  # the second and third did not fit
    assert ahead.request(keys) is True  # nothing more is started: the restore reads them from disk
    ahead.close()

