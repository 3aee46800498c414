"""``mlxkv generate --draft-model M`` and ``mlxkv chat --draft-model M`` speculate on the engine step with the draft
model's rows ``mlxkv serve --draft-model`` uses (batched draft forwards over the draft's own paged pool), not a loop of
their own: greedy output equals plain decoding with the target itself as draft (every proposal accepted) and with its
first layer as draft (few accepted); ``--verbose`` reports the acceptance the step counted; chat's draft follows the
conversation from turn to turn, its prefix cache holding what earlier turns committed; what cannot speculate on the
step drafts in rounds (recurrent layers, a seeded sampled answer) or is refused in one line.

Through typer's CliRunner: the random-weight test llama for generate, the embedded demo model for chat (reading its
input as from a pipe)."""

from __future__ import annotations

import pytest
from mlxkv.cli.main import app
from mlxkv.models import demo_model_path
from test_speculation_cli import (REPEATING, SPECULATIVE, TURN, _chat, full_length, no_round_loop,  # noqa: F401
                                  one_line)
from testkit.draft_models import first_layers
from typer.testing import CliRunner

runner = CliRunner()
pytestmark = pytest.mark.float_order


@pytest.fixture(scope="module")
def shallow_llama(llama_dir, tmp_path_factory):
    """The test llama's first layer, with its embedding, final norm and head: same vocabulary, few agreements."""
    return str(first_layers(llama_dir, 1, tmp_path_factory.mktemp("llama-1-layer")))


@pytest.fixture(scope="module")
def shallow_demo(tmp_path_factory):
    """The demo model's first layer (of four), as a draft for chat."""
    return str(first_layers(demo_model_path(), 1, tmp_path_factory.mktemp("demo-1-layer")))


@pytest.fixture
def draft_rows(monkeypatch):
    """The draft-model rows the command built (a list filled as they are built)."""
    import mlxkv.engine.build

    built, build = [], mlxkv.engine.build.draft_model_rows

    def spy(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(mlxkv.engine.build, "draft_model_rows", spy)
    return built


def acceptance(stderr: str) -> tuple[int, int, float]:
    found = SPECULATIVE.search(stderr)
    assert found, stderr
    rate, accepted, proposed, per_forward = map(float, found.groups())
    assert rate == pytest.approx(100 * accepted / proposed, abs=0.05)
    return int(accepted), int(proposed), per_forward


@pytest.mark.parametrize("store", [[], ["--kv-backend", "paged", "--kv-block-size", "8"]], ids=["dense", "paged"])
def test_generate_self_draft_on_the_step_accepts_everything_with_the_plain_text(llama_dir, no_round_loop, draft_rows,
                                                                               store):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "40", *store, REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--draft-model", llama_dir, "--num-draft-tokens", "4", "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "generation: 40 tokens" in spec.stderr
    accepted, proposed, per_forward = acceptance(spec.stderr)
    assert accepted == proposed > 0 and per_forward > 3
    (rows,) = draft_rows
    assert rows.totals["draft_forwards"] > 0 and len(rows.pool) == 0  # the draft ran; its sequence given back


def test_generate_shallow_draft_on_the_step_keeps_the_plain_text(llama_dir, shallow_llama, no_round_loop):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "40", REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--draft-model", shallow_llama, "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    accepted, proposed, _ = acceptance(spec.stderr)
    assert 0 < accepted < proposed  # proposals both accepted and rejected


def test_generate_samples_with_a_draft_on_the_step_unseeded(llama_dir, shallow_llama, no_round_loop):
    result = full_length(["generate", "-m", llama_dir, "--raw", "-n", "30", "--temp", "0.8", "--draft-model",
                          shallow_llama, "--verbose", REPEATING], 30)
    assert acceptance(result.stderr)[1] > 0


def test_generate_seeded_sampling_with_a_draft_runs_in_rounds_reproducibly(llama_dir, shallow_llama, draft_rows):
    args = ["generate", "-m", llama_dir, "--raw", "-n", "30", "--temp", "0.5", "--seed", "3", "--draft-model",
            shallow_llama, "--verbose", REPEATING]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == second.exit_code == 0, first.output
    assert first.stdout == second.stdout and acceptance(first.stderr)[1] > 0
    assert draft_rows == []  # the rounds' own dense draft, not the step's rows


def test_generate_draft_over_recurrent_layers_runs_in_rounds_with_the_plain_text(test_model_dir):
    model = str(test_model_dir("qwen3_next"))
    args = ["generate", "-m", model, "--raw", "-n", "16", REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--draft-model", model, "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and acceptance(spec.stderr)[0] > 0


def test_generate_with_a_penalty_and_a_draft_keeps_the_plain_greedy_text(llama_dir, no_round_loop):
    """The penalty applies at every proposed position over the tokens before it: the text is plain decoding's."""
    args = ["generate", "-m", llama_dir, "--raw", "-n", "24", "--repetition-penalty", "1.2", REPEATING]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "--draft-model", llama_dir, "--verbose"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and acceptance(spec.stderr)[1] > 0


# ------------------------------------------------------------------------------------------------------- chat
LINES = "Repeat after me: the quick brown fox jumps over the lazy dog.\nSay it again.\n"


@pytest.mark.parametrize("draft", ["self", "shallow"])
def test_chat_drafts_on_the_step_across_turns_with_the_plain_answers(tmp_path, shallow_demo, no_round_loop,
                                                                    draft_rows, draft):
    model = str(demo_model_path()) if draft == "self" else shallow_demo
    plain = _chat(tmp_path, "-n", "40", lines=LINES)
    spec = _chat(tmp_path, "-n", "40", "--draft-model", model, "--verbose", lines=LINES)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and len(spec.stdout.splitlines()) >= 2
    turns = [tuple(float(g) for g in t) for t in TURN.findall(spec.stderr)]
    assert len(turns) == 2, spec.stderr
    assert turns[1][1] > turns[0][0]  # the second turn continued the conversation's cache
    for _, _, rate, accepted, proposed, per_forward in turns:
        assert rate == pytest.approx(100 * accepted / proposed, abs=0.05) and proposed > 0
        assert accepted == proposed if draft == "self" else 0 < accepted < proposed
    (rows,) = draft_rows
    # The second turn's draft opened on the first turn's committed blocks: its prompt (the whole conversation) was
    # mostly a prefix hit in the draft's own pool, not fed again.
    assert rows.totals["draft_cached_tokens"] >= turns[0][0] - 16
    assert len(rows.pool) == 0


def test_chat_answer_cut_by_a_stop_string_gives_its_draft_back_and_the_next_turn_drafts(tmp_path, shallow_demo,
                                                                                        no_round_loop, draft_rows):
    """A stop string ends the first answer mid-speculation (the request is cancelled with proposals outstanding):
    the draft's sequence is released, and the next turn drafts again with the plain answer."""
    plain = _chat(tmp_path, "-n", "40", "--stop", "class", lines=LINES)
    spec = _chat(tmp_path, "-n", "40", "--stop", "class", "--draft-model", shallow_demo, "--verbose", lines=LINES)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    turns = TURN.findall(spec.stderr)
    assert len(turns) == 2 and all(int(t[4]) > 0 for t in turns), spec.stderr
    (rows,) = draft_rows
    assert len(rows.pool) == 0 and rows.totals["draft_failures"] == 0


def test_chat_refuses_a_missing_draft_before_loading_in_one_line(tmp_path, monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    line = one_line(_chat(tmp_path, "--draft-model", str(tmp_path / "no-such-draft"), lines="Hello\n"))
    assert line.startswith(f"error: --draft-model {tmp_path / 'no-such-draft'}: ")


@pytest.mark.parametrize("args, named", [
    (["--prompt-lookup"], "not both"),
    (["--kv-overflow", "window", "--kv-overflow-budget", "64"], "--kv-overflow"),
    (["--ngram-size", "2"], "--ngram-size"),
], ids=["both", "overflow", "ngram"])
def test_chat_refuses_what_a_draft_cannot_run_in_one_line(tmp_path, monkeypatch, args, named):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert named in one_line(_chat(tmp_path, "--draft-model", str(demo_model_path()), *args, lines="Hello\n"), 2)


def test_chat_refuses_a_draft_of_another_vocabulary_in_one_line(tmp_path, llama_dir):
    line = one_line(_chat(tmp_path, "--draft-model", llama_dir, lines="Hello\n"))
    assert "vocabulary" in line


def test_chat_set_takes_a_repetition_penalty_with_a_draft(tmp_path):
    done = _chat(tmp_path, "-n", "4", "--draft-model", str(demo_model_path()),
                 lines="/set repetition-penalty 1.3\nHello\n/set\n")
    assert done.exit_code == 0, done.output
    assert not [line for line in done.stderr.splitlines() if line.startswith("error:")], done.stderr
    assert done.stdout.strip() and "repetition-penalty 1.3" in done.stderr  # answered with the setting on
