"""Body-only Metal sources for ``mx.fast.metal_kernel`` (shipped as package data ``mlxkv.metal_kernels``)."""

from __future__ import annotations

from importlib import resources


def read_source(filename: str) -> str:
    """Text of one ``.metal`` source in this package, e.g. ``read_source("paged_merge.metal")``."""
    return resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
