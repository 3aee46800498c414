"""``mlxkv generate --prompt-lookup`` and ``mlxkv chat --prompt-lookup`` speculate on the engine step ``mlxkv serve``
runs (its proposals and verification rows, not a loop of their own): greedy output equals plain decoding while
proposals are both accepted and rejected, ``--verbose`` reports the acceptance the step counted, chat keeps its
conversation's cache from turn to turn (and over a loaded session) while it speculates, and what cannot
speculate is refused in one line.

Through typer's CliRunner: the random-weight test llama for generate (prompts after which its greedy output repeats
itself in part), the embedded demo model for chat (reading its input as from a pipe)."""

from __future__ import annotations

import re

import pytest
from mlxkv.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()
pytestmark = pytest.mark.float_order

#: Text after which the test llama's greedy continuation repeats it in part: lookups both accepted and rejected.
REPEATING = "abc abc abc abc abc abc"
SPECULATIVE = re.compile(r"speculative: acceptance ([\d.]+)% \((\d+) of (\d+) proposed\), ([\d.]+) tokens per target "
                         r"forward")
TURN = re.compile(r"\[turn: (\d+) prompt tokens, (\d+) cached, .* \| speculative: acceptance ([\d.]+)% "
                  r"\((\d+) of (\d+) proposed\), ([\d.]+) tokens per forward\]")


@pytest.fixture
def no_round_loop(monkeypatch):
    """Fail any generation of the round-by-round speculative engine: what passes ran on the engine step."""
    from mlxkv.engine.speculative import SpeculativeEngine

    def refuse(*args, **kwargs):
        raise AssertionError("SpeculativeEngine ran")

    monkeypatch.setattr(SpeculativeEngine, "generate_tokens", refuse)


def one_line(result, code: int = 1) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("store", [[], ["--kv-backend", "paged", "--kv-block-size", "8"]], ids=["dense", "paged"])
def test_generate_speculates_on_the_step_with_the_plain_greedy_text(llama_dir, no_round_loop, store):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "40", *store, REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--prompt-lookup", "--num-draft-tokens", "4", "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    found = SPECULATIVE.search(spec.stderr)
    assert found, spec.stderr
    acceptance, accepted, proposed, per_forward = map(float, found.groups())
    assert 0 < accepted < proposed and acceptance == pytest.approx(100 * accepted / proposed, abs=0.05)
    assert per_forward > 1  # fewer decode forwards than tokens
    assert "generation: 40 tokens" in spec.stderr


def full_length(args: list[str], tokens: int, attempts: int = 5):
    """The first of up to ``attempts`` runs of ``mlxkv generate args`` that samples all ``tokens`` tokens. An unseeded
    sampled answer of the random test llama ends at its end-of-sequence token now and then (1 to 10 runs in 100 at
    the temperatures these tests use): such a run is an answer too, and the next one is drawn afresh."""
    for _ in range(attempts):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        found = re.search(r"generation: (\d+) tokens", result.stderr)
        assert found and 0 < int(found.group(1)) <= tokens, result.stderr
        if int(found.group(1)) == tokens:
            return result
    raise AssertionError(f"{attempts} sampled runs ended before {tokens} tokens:\n{result.stderr}")


def test_generate_samples_with_speculation_unseeded(llama_dir, no_round_loop):
    # A low temperature and 60 tokens: the random test llama's sampled text then matches a lookup whatever the draws
    # (at 0.8 and 30 tokens some draws never do).
    result = full_length(["generate", "-m", llama_dir, "--raw", "-n", "60", "--temp", "0.1", "--prompt-lookup",
                          "--verbose", REPEATING], 60)
    found = SPECULATIVE.search(result.stderr)
    assert found and int(found.group(3)) > 0, result.stderr


def test_generate_speculates_with_a_repetition_penalty_and_the_plain_greedy_text(llama_dir, no_round_loop):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "30", "--repetition-penalty", "1.1", REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--prompt-lookup", "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert spec.stdout != runner.invoke(app, args[:-3] + [REPEATING]).stdout  # the penalty acts
    found = SPECULATIVE.search(spec.stderr)
    assert found and int(found.group(3)) > 0, spec.stderr  # tokens were proposed


def test_generate_seeded_sampling_speculates_in_rounds_reproducibly(llama_dir):
    """A seeded sampled answer draws from one seeded stream: it speculates round by round (the step's rows would
    draw it one token at a time), and the same seed gives the same text."""
    args = ["generate", "-m", llama_dir, "--raw", "-n", "30", "--temp", "0.1", "--seed", "3", "--prompt-lookup",
            "--verbose", REPEATING]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == second.exit_code == 0, first.output
    assert first.stdout == second.stdout and "generation: 30 tokens" in first.stderr
    found = SPECULATIVE.search(first.stderr)
    assert found and int(found.group(3)) > 0, first.stderr  # tokens were proposed


def test_generate_on_recurrent_layers_drafts_in_rounds_with_the_plain_greedy_text(test_model_dir):
    """Recurrent state cannot be cut inside a verification forward: such a model speculates round by round (the
    state snapshotted and replayed) and still answers as plain decoding does."""
    model = str(test_model_dir("qwen3_next"))
    args = ["generate", "-m", model, "--raw", "-n", "24", REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--prompt-lookup", "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and SPECULATIVE.search(spec.stderr)


# ------------------------------------------------------------------------------------------------------- chat
def _chat(tmp_path, *args: str, lines: str = ""):
    env = {"MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "MLXKV_MODELS_FILE": str(tmp_path / "models.json"),
           "COLUMNS": "300"}
    return runner.invoke(app, ["chat", *args], input=lines, env=env)


def test_chat_speculates_across_turns_with_the_plain_answers(tmp_path, no_round_loop):
    lines = "Repeat after me: the quick brown fox jumps over the lazy dog.\nSay it again.\n"
    plain = _chat(tmp_path, "-n", "40", lines=lines)
    spec = _chat(tmp_path, "-n", "40", "--prompt-lookup", "--verbose", lines=lines)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and len(spec.stdout.splitlines()) >= 2
    turns = [tuple(float(g) for g in t) for t in TURN.findall(spec.stderr)]
    assert len(turns) == 2, spec.stderr
    (first_prompt, first_cached, *_), (_, second_cached, *_) = turns
    assert first_cached == 0 and second_cached > first_prompt  # the second turn continued the conversation's cache
    for _, _, rate, accepted, proposed, per_forward in turns:
        assert 0 < accepted < proposed and rate == pytest.approx(100 * accepted / proposed, abs=0.05)
        assert per_forward > 1


def test_chat_set_takes_a_repetition_penalty_with_speculation(tmp_path):
    lines = "/set repetition-penalty 1.3\nHello\n/set\n"
    done = _chat(tmp_path, "-n", "6", "--prompt-lookup", lines=lines)
    assert done.exit_code == 0, done.output
    assert not [line for line in done.stderr.splitlines() if line.startswith("error:")], done.stderr
    assert done.stdout.strip() and "repetition-penalty 1.3" in done.stderr  # answered with the setting on


@pytest.mark.parametrize("args, named", [
    (["--num-draft-tokens", "4"], "--num-draft-tokens"),
    (["--prompt-lookup", "--kv-overflow", "window", "--kv-overflow-budget", "64"], "--prompt-lookup"),
], ids=["draft-tokens-alone", "overflow"])
def test_chat_refuses_speculation_it_cannot_run_in_one_line(tmp_path, monkeypatch, args, named):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert named in one_line(_chat(tmp_path, *args, lines="Hello\n"), 2)


def test_chat_refuses_a_seeded_sampled_start_in_one_line(tmp_path):
    line = one_line(_chat(tmp_path, "--prompt-lookup", "--temp", "0.5", "--seed", "1", lines="Hello\n"))
    assert "--seed" in line and "--prompt-lookup" in line


def test_chat_refuses_prompt_lookup_over_layers_it_cannot_rewind_in_one_line(tmp_path, test_model_dir):
    line = one_line(_chat(tmp_path, "-m", str(test_model_dir("qwen3_next")), "--prompt-lookup", lines="Hello\n"))
    assert "recurrent" in line and "run without --prompt-lookup" in line


def test_chat_speculates_over_a_loaded_session_with_the_plain_answers(tmp_path):
    lines = "Repeat after me: the quick brown fox.\n/save s\n/reset\n/load s\nSay it again.\n"
    plain = _chat(tmp_path / "plain", "-n", "30", lines=lines)
    spec = _chat(tmp_path / "spec", "-n", "30", "--prompt-lookup", "--verbose", lines=lines)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "loaded session s" in spec.stderr
    turns = TURN.findall(spec.stderr)
    assert len(turns) == 2 and int(turns[1][1]) > 0 and int(turns[1][4]) > 0  # cached from the session; proposals
