"""``mlxkv generate --prompt-file FILE`` and ``--logprobs N``, through the CLI (in-process, the embedded demo model):
the file's text is the prompt, refusals are one line, and the log-probabilities printed are those of the tokens the
answer holds (greedy: each token is its position's most likely alternative)."""

from __future__ import annotations

import ast
import math

from mlxkv.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()
PROMPT = "Name three colours."


def test_a_prompt_file_is_the_prompt(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT, encoding="utf-8")
    inline = runner.invoke(app, ["generate", "-n", "8", PROMPT])
    from_file = runner.invoke(app, ["generate", "-n", "8", "-f", str(path)])
    assert inline.exit_code == from_file.exit_code == 0, from_file.output
    assert from_file.stdout == inline.stdout and from_file.stdout.strip()


def test_prompt_file_refusals_are_one_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    for argv, code, fragment in ((["-f", str(tmp_path / "missing.txt")], 1, "No such file"),
                                 (["-f", str(tmp_path)], 1, "is a folder"),
                                 (["-f", str(tmp_path / "latin1.txt")], 1, "not UTF-8"),
                                 (["-f", str(tmp_path / "missing.txt"), PROMPT], 2, "give the prompt once")):
        result = runner.invoke(app, ["generate", *argv])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == code and len(lines) == 1 and fragment in lines[0], result.stderr


def test_logprobs_name_each_token_of_the_answer_with_its_alternatives():
    result = runner.invoke(app, ["generate", "-n", "6", "--logprobs", "3", PROMPT])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("logprobs")
    rows = [line.split("\t") for line in lines[1:] if "\t" in line]
    assert len(rows) == 6 and lines[-1] == "[cut at --max-tokens 6]"  # one row per token of the cut answer
    answer = "".join(ast.literal_eval(token) for token, *_ in rows)  # each token's text, as its repr
    assert answer.strip() == result.stdout.strip()
    for token, logprob, alternatives in rows:
        top = [a.rsplit("=", 1) for a in alternatives.split("  ")]
        assert len(top) == 3
        assert top[0][0] == token and math.isclose(float(top[0][1]), float(logprob), abs_tol=1e-3)  # greedy
        assert float(logprob) <= 0


def test_logprobs_with_speculative_decoding_are_refused_in_one_line():
    result = runner.invoke(app, ["generate", "--logprobs", "1", "--prompt-lookup", PROMPT])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "--logprobs" in lines[0], result.stderr


def test_a_prefilled_response_is_continued_with_its_spacing():
    """``--prefill-response TEXT``: the model continues the answer TEXT starts; what is printed is the continuation,
    which reads on from TEXT exactly as the whole answer decodes (no space lost at the join)."""
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.models import load
    from mlxkv.prompt import encode_prompt

    start = "The three colours are"
    result = runner.invoke(app, ["generate", "-n", "6", "--prefill-response", start, PROMPT])
    assert result.exit_code == 0, result.output
    demo = load(None, progress=False)
    primer = list(demo.tokenizer.encode(start, add_special_tokens=False))
    tokens = list(DirectEngine(demo.model, demo.tokenizer).generate_tokens(
        encode_prompt(demo.tokenizer, PROMPT) + primer, SamplingParams(max_tokens=6)))
    whole = demo.tokenizer.decode(primer + tokens)
    assert whole.startswith(demo.tokenizer.decode(primer))
    assert result.stdout.rstrip("\n") == whole[len(demo.tokenizer.decode(primer)):] and result.stdout.strip()
    for argv, fragment in ((["--raw"], "--raw"), ([], "is empty")):
        refused = runner.invoke(app, ["generate", *argv, "--prefill-response", "" if not argv else start, PROMPT])
        lines = refused.stderr.strip().splitlines()
        assert refused.exit_code == 1 and len(lines) == 1 and fragment in lines[0], refused.stderr


def test_chat_set_stop_ends_answers_at_the_text(tmp_path):
    """``/set stop TEXT`` in chat: later answers end before TEXT; ``/set stop none`` clears it; ``/set`` shows it."""
    env = {"MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "MLXKV_MODELS_FILE": str(tmp_path / "models.json")}
    free = runner.invoke(app, ["chat", "-n", "24"], input=f"{PROMPT}\n", env=env)
    assert free.exit_code == 0, free.output
    answer = free.stdout.strip()
    cut = answer.split()[2]  # a word inside the free answer
    done = runner.invoke(app, ["chat", "-n", "24"], input=f"/set stop {cut}\n/set\n{PROMPT}\n/set stop none\n/set\n",
                         env=env)
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == answer[:answer.index(cut)].strip()
    assert f"stop set to {cut!r}" in done.stderr and f"stop {cut!r}" in done.stderr
    assert "stop set to none" in done.stderr and done.stderr.rstrip().endswith("stop none")
