"""A tier folder's content for people (``mlxkv cache ls``): verified headers grouped into chains, bad files named.

Read-only and total: every file is either a verified entry or a ``(name, reason)`` in ``bad``; a file of another
name holding a block already listed counts once; chains are walked with a visited set, so files naming each
other as parents (a cycle) are listed once, as a chain of their own, and never loop.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.kv.tier.disk_store import is_tier_temp, read_header_file
from mlxkv.kv.tier.format import FILE_SUFFIX, FormatError
from mlxkv.kv.tier.header import TierHeader
from mlxkv.kv.tier.seal import Seal


@dataclass(slots=True)
class Entry:
    """One verified block file."""

    header: TierHeader
    size: int  # bytes on disk
    complete: bool  # the size matches the header (False: truncated, the store drops it)

    @property
    def key(self) -> tuple[str, int, str]:
        return self.header.fingerprint.digest, self.header.group_id, self.header.block_hash

    @property
    def parent_key(self) -> tuple[str, int, str] | None:
        h = self.header
        return None if h.parent_hash is None else (h.fingerprint.digest, h.group_id, h.parent_hash)


@dataclass(slots=True)
class Listing:
    entries: list[Entry] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file name, why it is not listed)
    duplicates: int = 0  # files holding a block another file already holds


def list_folder(folder: Path, seal: Seal | None) -> Listing:
    """Every block file of ``folder`` checked against ``seal`` (None: the secret is missing, so every file is bad:
    nothing in it can be verified)."""
    out, seen = Listing(), set()
    for path in sorted(folder.iterdir()):
        if not path.name.endswith(FILE_SUFFIX) or path.name.startswith(".") or is_tier_temp(path):
            continue
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                out.bad.append((path.name, "not a regular file"))
                continue
            if seal is None:
                out.bad.append((path.name, "no tier secret beside the folder: cannot verify"))
                continue
            header, expected = read_header_file(path, seal)
        except (OSError, FormatError) as exc:
            out.bad.append((path.name, str(exc)))
            continue
        entry = Entry(header, st.st_size, st.st_size == expected)
        if entry.key in seen:
            out.duplicates += 1
            continue
        seen.add(entry.key)
        out.entries.append(entry)
    return out


def chains(entries: list[Entry]) -> list[list[Entry]]:
    """Entries grouped into chains: each root (no parent present) with the blocks reachable from it through parent
    hashes, then whatever no root reaches (cycles), each cycle once. Every entry is in exactly one chain."""
    present = {e.key for e in entries}
    children: dict[tuple, list[Entry]] = {}
    roots = []
    for e in entries:
        parent = e.parent_key
        if parent is not None and parent in present and parent != e.key:
            children.setdefault(parent, []).append(e)
        else:
            roots.append(e)
    visited: set[tuple] = set()
    out = []
    for start in roots + entries:  # roots first; then any entry left over sits on a cycle
        if start.key in visited:
            continue
        chain, stack = [], [start]
        while stack:
            e = stack.pop()
            if e.key in visited:
                continue
            visited.add(e.key)
            chain.append(e)
            stack.extend(children.get(e.key, []))
        out.append(chain)
    return out
