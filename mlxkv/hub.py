"""Hugging Face Hub details of model loading: ``owner/name@revision`` specs and download progress on stderr.

huggingface_hub's ``snapshot_download`` draws its byte bars with the ``tqdm_class`` it is given, starting them at
``total=0`` and raising ``total`` as file sizes become known (then ``refresh()``). A plain tqdm redraws that; the
bars write to stderr so that redirected output holds only the generated text.
"""

from __future__ import annotations

import sys

from huggingface_hub.utils import tqdm as hf_tqdm


class StderrProgress(hf_tqdm):
    """huggingface_hub's tqdm (it honours ``HF_HUB_DISABLE_PROGRESS_BARS``), always drawing on stderr."""

    def __init__(self, *args, **kwargs):
        kwargs["file"] = sys.stderr  # read at call time: a test's or a redirect's stderr, never stdout
        super().__init__(*args, **kwargs)


class NoProgress(StderrProgress):
    """The same bars, never drawn (``progress=False``): the hub still updates their totals and counts."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def split_revision(spec: str) -> tuple[str, str | None]:
    """``("owner/name", "rev")`` for ``owner/name@rev``; ``(spec, None)`` without an ``@``.

    Raises:
        ValueError: an ``@`` with nothing after it.
    """
    name, at, revision = spec.rpartition("@")
    if not at:
        return spec, None
    if not revision or not name:
        raise ValueError(f"{spec!r}: expected owner/name@revision (a branch, tag or commit after the @)")
    return name, revision


__all__ = ["StderrProgress", "NoProgress", "split_revision"]
