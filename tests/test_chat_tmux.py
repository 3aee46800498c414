"""``mlxkv chat`` in a real terminal (tmux send-keys / capture-pane) with the embedded demo model: the second
turn prefills only the new tokens, ``/save`` then ``--resume`` continues as the live session does, Ctrl-C stops
an answer without leaving, a conversation past ``--max-kv-size`` keeps answering, Ctrl-D leaves."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from testkit.terminal import TMUX, Terminal

pytestmark = [
    pytest.mark.terminal,
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)"),
]
ROOT = Path(__file__).resolve().parent.parent
STATS = re.compile(r"context: (\d+) tokens.*KV cache ([\d.]+) MB\nlast turn: (\d+) prompt tokens, (\d+) cached, "
                   r"(\d+) prefilled \(([\d.]+) tok/s\), (\d+) generated \(([\d.]+) tok/s\)")


@pytest.fixture
def chat(tmp_path):
    """Start ``mlxkv chat ARGS`` in a terminal (sessions under tmp_path); every terminal is closed afterwards."""
    terminals = []
    env = {"PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "HOME": str(tmp_path)}
    for name in ("LD_PRELOAD",):
        if os.environ.get(name):
            env[name] = os.environ[name]

    def start(*args: str) -> Terminal:
        term = Terminal(["chat", *args], env, ROOT)
        terminals.append(term)
        term.wait_for(r"^>>>$", timeout=120)
        return term

    yield start
    for term in terminals:
        term.close()


def _stats(term: Terminal) -> dict[str, float]:
    found = STATS.search(term.send("/stats"))
    assert found, term.screen()
    keys = ("context", "kv_mb", "prompt", "cached", "prefilled", "prefill_tps", "generated", "decode_tps")
    return dict(zip(keys, (float(g) for g in found.groups())))


def _stop_an_answer(term: Terminal, message: str, turn_line: bool = False, attempts: int = 5) -> None:
    """Type ``message`` and press Ctrl-C once its answer streams, until the chat shows ``[stopped]``. The demo model
    can finish a long answer within a second; when it ends before the key lands (a busy machine can delay the key
    by that much), the key clears the next prompt instead, and the answer is dropped with /reset and the message
    typed again."""
    stopped = r"^\[stopped\]\n" + (r"\[turn: .*\]\n" if turn_line else "") + r">>>\Z"
    typed = rf"^>>> {re.escape(message)}\n.+\n"  # the message, then a line of its answer
    for attempt in range(1, attempts + 1):
        count = len(re.findall(typed, term.screen(), re.MULTILINE)) + 1
        term.type(message)
        term.wait_for(typed, timeout=60, count=count)
        term.key("C-c")
        screen = term.wait_for(rf"{stopped}|^>>>\n>>>\Z", timeout=30)
        if re.search(stopped, screen, re.MULTILINE):
            return
        assert term.send("/reset") == "new conversation"
    raise AssertionError(f"no answer of {attempts} stopped; the terminal shows:\n{term.screen()}")


def test_the_second_turn_prefills_only_the_new_tokens(chat):
    term = chat("-n", "12", "--system", "Be brief.")
    assert term.send("Hello, who are you?")
    first = _stats(term)
    assert first["cached"] == 0 and first["prefilled"] == first["prompt"] and first["generated"] == 12
    assert first["context"] == first["prompt"] + 11  # the last answer token is sampled, not yet run
    assert term.send("Tell me about the sea.")
    second = _stats(term)
    assert second["cached"] == first["context"]  # the whole first turn comes from the cache
    assert second["prefilled"] == second["prompt"] - first["context"] < 20  # the new message and its markers
    assert second["kv_mb"] > 0 and second["prefill_tps"] > 0 and second["decode_tps"] > 0
    assert term.send("/frobnicate now") == "unknown command /frobnicate: /help lists the commands"
    assert "/save NAME" in term.send("/help")
    term.key("C-d")
    assert term.exit_status() == 0


def test_save_then_resume_continues_as_the_live_session(chat):
    live = chat("-n", "12")
    live.send("Hello, who are you?")
    saved = live.send("/save first")
    assert re.fullmatch(r"saved session first \(\d+ tokens\) to .*first\.safetensors", saved), saved
    tokens = _stats(live)["context"]
    live_answer = live.send("Tell me about the sea.")
    assert live_answer
    resumed = chat("-n", "12", "--resume", "first")
    assert f"resumed session first: 2 messages, {int(tokens)} tokens cached" in resumed.screen()
    assert resumed.send("Tell me about the sea.") == live_answer
    assert _stats(resumed)["cached"] == tokens  # the resumed turn prefilled none of the history
    assert "saved with" not in resumed.send("/load first")
    assert resumed.send("/load nothing").startswith("error: no saved session 'nothing'")


def test_ctrl_c_stops_the_answer_and_the_next_turn_works(chat):
    # 480 tokens: a stopped first answer (< 480 tokens) plus the next message and its answer (at most 480) fit the
    # demo model's 1,024-token context, so the second turn never drops the first.
    term = chat("-n", "480")
    _stop_an_answer(term, "Write a very long story about everything.")
    stats = _stats(term)
    assert 0 < stats["generated"] < 480
    assert term.send("Hello")  # the next turn answers, over the stopped turn's cache
    again = _stats(term)
    assert again["cached"] == stats["context"] and 0 < again["generated"] <= 480
    term.key("C-c")  # at the prompt: a fresh prompt, the command stays
    term.wait_for(r"^>>>\n>>>\Z", timeout=30)
    assert term.send("/stats")
    term.key("C-d")
    assert term.exit_status() == 0


def test_a_conversation_past_max_kv_size_keeps_answering(chat):
    term = chat("-n", "12", "--max-kv-size", "96", "--system", "Be brief.")
    dropped = 0
    for i in range(7):
        out = term.send(f"Question number {i}: what comes next?")
        assert out.strip(), term.screen()
        dropped += "earliest turn(s) dropped to fit the context" in out
        stats = _stats(term)
        assert stats["context"] <= 96
    assert dropped >= 2
    term.key("C-d")
    assert term.exit_status() == 0


@pytest.mark.slow
def test_prompt_lookup_answers_as_plain_chat_and_a_stopped_answer_keeps_the_cache(chat):
    messages = ("Repeat after me: the quick brown fox jumps over the lazy dog.", "Say it again.")
    plain = chat("-n", "40")
    spec = chat("-n", "40", "--prompt-lookup", "--verbose")
    for message in messages:
        expected = plain.send(message)
        answer, _, turn = spec.send(message).rpartition("\n")  # the answer (and its marks), then the turn's line
        assert answer == expected
        found = re.search(r"cached, .* speculative: acceptance [\d.]+% \((\d+) of (\d+) proposed\), ([\d.]+) tokens "
                          r"per forward\]$", turn)
        assert found and int(found.group(2)) > 0, turn
    # A speculating answer stopped by Ctrl-C leaves the cache at what was shown: the next turn reuses all of it.
    spec.send("/set max-tokens 480")
    _stop_an_answer(spec, "Write a very long story about everything.", turn_line=True)
    stopped = _stats(spec)
    spec.send("/set max-tokens 40")  # the next turn fits the context beside a stopped answer of any length
    assert spec.send("Hello")
    assert _stats(spec)["cached"] == stopped["context"]
    spec.key("C-d")
    assert spec.exit_status() == 0
