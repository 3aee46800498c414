"""``mlxkv chat`` with the real SmolLM2-135M-Instruct: a two-turn conversation answers exactly what ``mlxkv serve``
answers through the official openai client for the same messages, and what ``mlxkv generate`` answers for each
turn's whole rendered conversation (greedy), although chat's second turn prefills only the new message over the
cached first turn. Skipped without ``MLXKV_TEST_GGUF``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.real_model import GGUF
from testkit.serve_process import serve_process

pytestmark = [pytest.mark.real_model, pytest.mark.server]
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a helpful assistant."
QUESTIONS = ("What is the capital of France?", "And what is it famous for?")
TOKENS = 16


def test_chat_answers_as_serve_does_for_the_same_conversation(tmp_path):
    with serve_process("-m", str(GGUF), "--dequantize", "--max-sequences", "1", "--log-level", "warning") as client:
        messages = [{"role": "system", "content": SYSTEM}]
        answers = []
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            reply = client.chat.completions.create(model="default", messages=messages, max_tokens=TOKENS,
                                                   temperature=0)
            answers.append(reply.choices[0].message.content)
            messages.append({"role": "assistant", "content": answers[-1]})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path)}
    lines = "\n".join([QUESTIONS[0], "/stats", QUESTIONS[1], "/stats"]) + "\n"
    done = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS),
                           "--system", SYSTEM], input=lines, capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert all(answers), answers
    assert done.stdout == "".join(f"{answer}\n" for answer in answers), (answers, done.stdout)  # answers alone
    stats = re.findall(r"context: (\d+) tokens.*\nlast turn: (\d+) prompt tokens, (\d+) cached, (\d+) prefilled",
                       done.stderr)  # the commands' replies
    assert len(stats) == 2, done.stderr
    (first_context, _, _, _), (_, prompt, cached, prefilled) = [tuple(map(int, s)) for s in stats]
    assert cached == first_context  # the whole first turn (prompt and answer) came from the cache
    assert prefilled == prompt - cached < 20  # the new question and the template's markers only


def _mlxkv(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "mlxkv", *args], input=stdin, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


def test_chat_answers_as_generate_does_for_each_turns_whole_conversation(tmp_path):
    lines = "\n".join([QUESTIONS[0], QUESTIONS[1]]) + "\n"
    chat = _mlxkv("chat", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS), "--system", SYSTEM, "--verbose",
                  stdin=lines, env={"MLXKV_SESSIONS_DIR": str(tmp_path)})
    answers = chat.stdout.splitlines()
    turns = [tuple(map(int, t)) for t in re.findall(r"\[turn: (\d+) prompt tokens, (\d+) cached, (\d+) prefilled",
                                                    chat.stderr)]
    assert len(answers) == len(turns) == 2 and all(answers), (chat.stdout, chat.stderr)
    assert turns[0][1] == 0 and turns[1][1] > turns[0][0]  # the second turn continued the first turn's cache
    first = _mlxkv("generate", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS), "--system", SYSTEM, QUESTIONS[0])
    assert first.stdout == answers[0] + "\n"
    # The second turn's whole conversation as generate's prompt: SmolLM2's template (ChatML), encoded raw; the
    # prompt sizes agree, so generate prefilled from nothing exactly the tokens chat had cached and prefilled.
    rendered = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in (
        ("system", SYSTEM), ("user", QUESTIONS[0]), ("assistant", answers[0]), ("user", QUESTIONS[1])))
    second = _mlxkv("generate", "-m", str(GGUF), "--dequantize", "-n", str(TOKENS), "--raw", "--verbose",
                    rendered + "<|im_start|>assistant\n")
    assert f"prompt: {turns[1][0]} tokens" in second.stderr, second.stderr
    assert second.stdout == answers[1] + "\n"
