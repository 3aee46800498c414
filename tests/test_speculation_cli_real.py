"""``--prompt-lookup`` in ``mlxkv generate`` and ``mlxkv chat`` with the real SmolLM2-135M-Instruct on an edit
prompt (return this code with one name changed): the speculative greedy answer equals the plain greedy one, token
for token as text, while most proposals are accepted; chat does so over two turns, the second continuing the first's
cache. Skipped without ``MLXKV_TEST_GGUF``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.real_model import GGUF

pytestmark = [pytest.mark.real_model, pytest.mark.float_order]
ROOT = Path(__file__).resolve().parent.parent
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax_rate)'''
EDIT = f"Return this Python code exactly, with `subtotal` renamed to `amount`. Reply with the code only.\n\n{CODE}"
TOKENS = 64


def _mlxkv(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "mlxkv", *args], input=stdin, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


def test_generate_prompt_lookup_answers_an_edit_as_plain_greedy_does():
    args = ("generate", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS), EDIT)
    plain = _mlxkv(*args)
    spec = _mlxkv(*args, "--prompt-lookup", "--num-draft-tokens", "6", "--verbose")
    assert spec.stdout == plain.stdout and "tax_rate" in spec.stdout
    found = re.search(r"speculative: acceptance ([\d.]+)% \(\d+ of \d+ proposed\), ([\d.]+) tokens per target "
                      r"forward", spec.stderr)
    assert found, spec.stderr
    assert float(found.group(1)) > 50 and float(found.group(2)) > 2  # an edit copies its prompt


def test_chat_prompt_lookup_answers_two_turns_as_plain_chat_does(tmp_path):
    lines = f'"""\n{EDIT}\n"""\nNow rename `items` to `products` too.\n'
    args = ("chat", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS), "--verbose")
    env = {"MLXKV_SESSIONS_DIR": str(tmp_path)}
    plain = _mlxkv(*args, stdin=lines, env=env)
    spec = _mlxkv(*args, "--prompt-lookup", "--num-draft-tokens", "6", stdin=lines, env=env)
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    turns = re.findall(r"\[turn: (\d+) prompt tokens, (\d+) cached, .* \| speculative: acceptance ([\d.]+)% "
                       r"\((\d+) of (\d+) proposed\)", spec.stderr)
    assert len(turns) == 2, spec.stderr
    (prompt, _, _, _, _), (_, cached, _, accepted, proposed) = turns
    assert int(cached) > int(prompt)  # the second turn continued the first turn's cache
    assert int(accepted) > int(proposed) // 2  # its answer copies the conversation's code
