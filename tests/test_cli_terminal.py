"""The terminal a newcomer meets (issue 37), through the CLI: a refused chat command leaves the chat running,
chat checks its settings as generate does, a GGUF used through chat is listed and removable by its ``-m`` value,
a cut answer is marked, flags that would do nothing are refused, every bad option value is one line and a
non-zero exit, messages name the real problem, ``--help`` reads plainly, a prefill stops between chunks.

Typer's runner runs the commands in-process with the embedded demo model, chat reading its input as from a pipe.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest
import typer
from mlxkv.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()


class _Done:
    """A chat run as the tests read it (a subprocess's names)."""

    def __init__(self, result):
        self.returncode, self.stdout, self.stderr = result.exit_code, result.stdout, result.stderr


def _chat(tmp_path: Path, *args: str, lines: str = "") -> _Done:
    """``mlxkv chat ARGS`` fed ``lines`` as a pipe would (in-process: the demo model loads in about a second)."""
    env = {"MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "MLXKV_MODELS_FILE": str(tmp_path / "models.json"),
           "COLUMNS": "300"}
    return _Done(runner.invoke(app, ["chat", *args], input=lines, env=env))


def one_line(result, code: int | None = None) -> str:
    """The single ``error: ...`` line a failed command printed (and nothing else on stderr, no traceback)."""
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ------------------------------------------------------------------------------------------------ 1: chat goes on
def test_a_refused_save_leaves_the_chat_and_the_conversation(tmp_path):
    lines = "Hello\n/save one\nAnd then?\n/stats\n"
    done = _chat(tmp_path, "-n", "6", "--kv-overflow", "h2o", "--kv-overflow-budget", "64", lines=lines)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot be saved" in errors[0], done.stderr
    assert len(done.stdout.splitlines()) == 2  # both messages answered: the chat went on after the refusal
    assert "last turn:" in done.stderr and " 0 cached" not in done.stderr  # the second turn reused the first's cache
    assert not (tmp_path / "sessions" / "one.safetensors").exists()


def test_a_session_folder_that_is_a_file_is_refused_at_start(tmp_path):
    afile = tmp_path / "notes.md"
    afile.write_text("not a folder")
    result = runner.invoke(app, ["chat", "--sessions-dir", str(afile)])
    assert f"{afile} is a file, not a folder" in one_line(result, 2)


# ----------------------------------------------------------------------------------- 3: chat checks as generate
def test_chat_and_generate_refuse_the_same_max_kv_size(monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    chat = one_line(runner.invoke(app, ["chat", "--max-kv-size", "3"]), 2)
    generate = one_line(runner.invoke(app, ["generate", "--max-kv-size", "3", "hi"]), 2)
    assert chat == generate and "greater than 4" in chat
    help_text = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "300"}).stdout
    assert "(x > 4)" in " ".join(help_text.split())  # the help states the bound the check applies


def test_chat_refuses_a_kv_group_that_does_not_divide_head_dim_at_start(tmp_path):
    args = ["--kv-bits", "4", "--kv-group-size", "128"]  # the demo model's head_dim is 48
    chat = _chat(tmp_path, *args, lines="Hello\n")
    generate = runner.invoke(app, ["generate", *args, "Hello"])
    assert chat.returncode == 1 and chat.stdout == "" and chat.stderr.strip() == one_line(generate, 1)
    assert "head_dim 48 is not divisible by the KV quantization group size 128" in chat.stderr


# ----------------------------------------------------------------------------------------- 4: models and chat
def test_a_gguf_used_through_chat_is_listed_and_removed_by_its_folder(tmp_path, test_model_dir):
    from testkit.gguf_files import write_gguf

    folder = tmp_path / "llm_tiny"
    folder.mkdir()
    gguf = write_gguf(test_model_dir("llama"), folder / "tiny.Q8_0.gguf", "Q8_0")
    _chat(tmp_path, "-m", str(folder), "-n", "2", lines="")  # loads, then leaves at the end of input
    env = {"MLXKV_MODELS_FILE": str(tmp_path / "models.json")}
    listed = runner.invoke(app, ["models"], env=env)
    assert listed.exit_code == 0 and str(gguf.resolve()) in listed.stdout, listed.output
    as_json = json.loads(runner.invoke(app, ["models", "--json"], env=env).stdout)
    assert {"model": str(gguf.resolve()), "bytes": gguf.stat().st_size, "source": "gguf"}.items() <= as_json[-1].items()
    removed = runner.invoke(app, ["models", "rm", str(folder), "--yes"], env=env)
    assert removed.exit_code == 0 and removed.stdout.strip() == f"forgot {gguf.resolve()}", removed.output
    assert str(gguf.resolve()) not in runner.invoke(app, ["models"], env=env).output


# ------------------------------------------------------------------------------------------- 5: a cut answer
def test_a_cut_answer_is_marked_in_chat_and_generate(tmp_path):
    done = _chat(tmp_path, "-n", "5", lines="Hello\n")
    assert done.returncode == 0 and "[answer cut at --max-tokens 5]" in done.stderr, done.stderr
    assert "cut" not in done.stdout
    result = runner.invoke(app, ["generate", "-n", "5", "The import statement"])
    assert result.exit_code == 0 and result.stderr.strip() == "[cut at --max-tokens 5]", result.output


def test_chat_answers_up_to_512_tokens_by_default():
    params = {p.name: p for p in typer.main.get_command(app).commands["chat"].params}
    assert params["max_tokens"].default == 512


# ------------------------------------------------------------------------------ 6: one rule, one line per error
@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("args, fragment", [
    (["--seed", "1"], "--seed"), (["--top-p", "0.5"], "--top-p"), (["--top-k", "5"], "--top-k"),
    (["--min-p", "0.1"], "--min-p"), (["--stop", ""], "an empty stop string matches nothing"),
])
def test_flags_that_would_do_nothing_are_refused(command, args, fragment, monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    line = one_line(runner.invoke(app, [command, *args] + (["hi"] if command == "generate" else [])), 2)
    assert fragment in line


def test_flags_that_would_do_something_are_accepted():
    result = runner.invoke(app, ["generate", "--temp", "0.7", "--top-p", "0.9", "--top-k", "20", "--seed", "1",
                                 "-n", "3", "The import statement"])
    assert result.exit_code == 0, result.output


def test_dequantize_on_an_unquantized_model_is_refused(tmp_path):
    line = one_line(runner.invoke(app, ["generate", "--dequantize", "hi"]), 1)
    assert line == "error: --dequantize has no effect: mlxkv-demo has no quantized weights (drop --dequantize)"
    done = _chat(tmp_path, "--dequantize")
    assert done.returncode == 1 and done.stderr.strip() == line
    served = runner.invoke(app, ["serve", "--dequantize", "--port", "0"])
    assert one_line(served, 1) == line


def _commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, command


def _value_options():
    for path, command in _commands():
        arguments = ["x" for p in command.params if p.param_type_name == "argument"]
        for p in command.params:
            if p.param_type_name == "option" and not p.is_flag:
                yield pytest.param(path, p, arguments, id=f"{' '.join(path)} {p.opts[0]}")


#: Options whose every text is a valid value (a name, a key, a model to look for): the bad value reaches the step
#: that uses it, and that step fails in one line.
FREE_TEXT = {"--model", "--served-model-name", "--api-key", "--api-keys-file", "--metrics-key", "--admin-key",
             "--tool-parser",
             "--kv-disk-cache", "--sessions-dir", "--draft-model", "--json-schema", "--url", "--resume", "--host",
             "show --revision", "pull --revision"}


@pytest.mark.parametrize("path, option, arguments", list(_value_options()))
def test_every_option_refuses_a_bad_value_in_one_line(path, option, arguments, monkeypatch):
    import mlxkv.models

    def no_model(*args, **kwargs):
        raise mlxkv.models.ModelLoadError("no model in this test")

    monkeypatch.setattr(mlxkv.models, "load", no_model)  # an option let through fails here, one line too
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    numeric = option.type_descriptor.annotation in (int, float, Optional[int], Optional[float])
    bad = "bogus" if numeric else "bogus\udcff"  # text options: not UTF-8 (the only text some refuse)
    flag = option.opts[0]
    result = runner.invoke(app, [*path, flag, bad, *arguments])
    line = one_line(result)
    if flag not in FREE_TEXT and f"{' '.join(path)} {flag}" not in FREE_TEXT:
        assert result.exit_code == 2 and flag in line, line  # refused as the option's error, before any work


def test_usage_errors_are_one_line():
    for argv, fragment in ((["generate"], "no prompt: give it as the argument, with -p TEXT"),
                           (["generate", "--kv-cache-budget", "1KB", "x"], "No such option: --kv-cache-budget"),
                           (["frobnicate"], "No such command 'frobnicate'"),
                           (["generate", "--dequantize=yes", "x"], "does not take a value")):
        line = one_line(runner.invoke(app, argv), 2)
        assert fragment in line, line


# ------------------------------------------------------------------------------------------ 7: the real problem
def test_messages_name_the_real_problem(tmp_path):
    folder = tmp_path / "templates"
    folder.mkdir()
    assert f"{folder} is a folder, not a file" in one_line(runner.invoke(app, ["generate", "--chat-template",
                                                                                str(folder), "hi"]), 2)
    missing = tmp_path / "kv"
    assert one_line(runner.invoke(app, ["cache", "ls", str(missing)]), 1) == (
        f"error: {missing} does not exist yet: `mlxkv serve --kv-disk-cache {missing}` creates it")
    assert one_line(runner.invoke(app, ["convert", str(tmp_path / "none.gguf"), str(tmp_path / "out")]), 1) == (
        f"error: no such file: {tmp_path / 'none.gguf'}")
    budget = one_line(runner.invoke(app, ["serve", "--kv-cache-budget", "1KB", "--port", "0"]), 1)
    assert "--kv-cache-budget" in budget and "kv_cache_budget" not in budget and "free_memory_fraction" not in budget


def test_heads_are_named_in_words():
    from mlxkv.distributed.group import shard_model

    class Attention:
        n_heads, n_kv_heads = 9, 3

    class Layer:
        self_attn = Attention()

    class Model:
        layers = [Layer()]

        def shard(self, group):
            raise AssertionError("not reached")

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 0

    with pytest.raises(ValueError, match="the model has 9 attention heads per layer, which 2 ranks do not divide"):
        shard_model(Model(), Group(), "tensor")


# --------------------------------------------------------------------------------------------------- 9: --help
@pytest.mark.parametrize("path", [p for p, _ in _commands()] + [(), ("models",), ("cache",)],
                         ids=lambda p: " ".join(p) or "mlxkv")
def test_help_reads_plainly(path):
    text = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).stdout
    assert "Usage: mlxkv" in text
    for typer_ism in ("<bool>", "range>", "{"):
        assert typer_ism not in text.split("Usage:")[1].split("\n")[0] if typer_ism == "{" else typer_ism not in text


def test_help_of_chat_and_serve_describe_them():
    chat = " ".join(runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "Paged" not in chat and "cannot be saved with /save" in chat
    serve = " ".join(runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "Anthropic" in serve and "[default: (16GiB)]" in serve


# -------------------------------------------------------------------------------------- 8: multi-line input
def test_a_message_of_several_lines(tmp_path):
    lines = '"""\nfirst line\nsecond line\n"""\n/stats\n"""one line"""\n/help\n'
    done = _chat(tmp_path, "-n", "3", lines=lines)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2  # two messages answered, not four
    assert '"""' in done.stderr.split("commands:")[1]  # /help documents it
    assert "unknown command" not in done.stderr


# ------------------------------------------------------------------------------- 2: a prefill stops between chunks
def test_a_prefill_stops_between_chunks_and_keeps_what_ran():
    import mlx.core as mx
    from mlxkv.engine.prefill import PrefillStopped, prefill
    from mlxkv.kv import make_caches
    from mlxkv.models import load

    loaded = load(None)
    caches = make_caches(loaded.model)
    calls = []

    def stop_on_third() -> bool:
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(PrefillStopped) as stopped:
        prefill(loaded.model, caches, mx.arange(1, 400, dtype=mx.uint32), should_stop=stop_on_third)
    assert 0 < stopped.value.done < 399
    assert {c.offset for c in caches} == {stopped.value.done}  # every layer holds exactly the chunks that ran


# ------------------------------------------------------------------------- 10: options users reach for
def test_repetition_penalty_reaches_generate_and_chat(tmp_path):
    def generate(*args):
        result = runner.invoke(app, ["generate", "-n", "24", *args, "The import statement"])
        assert result.exit_code == 0, result.output
        return result.stdout

    assert generate("--repetition-penalty", "1.5") != generate()
    assert generate("--repetition-penalty", "1") == generate()  # 1 is no penalty
    plain = _chat(tmp_path, "-n", "24", lines="Hello\nTell me more\n").stdout
    penalized = _chat(tmp_path, "-n", "24", "--repetition-penalty", "1.5", lines="Hello\nTell me more\n").stdout
    assert penalized != plain
    assert "--repetition-penalty" in one_line(runner.invoke(app, ["generate", "--repetition-penalty", "0", "x"]), 2)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if long %}a b c d e f g h "
                        "{% endif %}")

    def prompt_tokens(*args):
        result = runner.invoke(app, ["generate", "-n", "2", "--verbose", "--chat-template", str(template), *args,
                                     "The import statement"])
        assert result.exit_code == 0, result.output
        return int(re.search(r"prompt: (\d+) tokens", result.stderr).group(1))

    assert prompt_tokens("--chat-template-kwargs", '{"long": true}') > prompt_tokens()
    stats = _chat(tmp_path, "-n", "2", "--chat-template", str(template), "--chat-template-kwargs",
                  '{"long": true}', lines="Hello\n/stats\n").stderr
    plain = _chat(tmp_path, "-n", "2", "--chat-template", str(template), lines="Hello\n/stats\n").stderr
    count = re.compile(r"last turn: (\d+) prompt tokens")
    assert int(count.search(stats).group(1)) > int(count.search(plain).group(1))
    assert "not valid JSON" in one_line(runner.invoke(app, ["chat", "--chat-template-kwargs", "{"]), 2)


def test_chat_undo_retry_and_set(tmp_path):
    lines = "Hello\n/retry\n/undo\n/undo\n/set top-p 0.5\n/set temp 0.8\n/set top-p 0.5\n/set top-k x\n/set\n"
    done = _chat(tmp_path, "-n", "6", lines=lines)
    assert done.returncode == 0, done.stderr
    first, again = done.stdout.splitlines()
    assert first == again  # greedy: the retried answer is the same
    err = done.stderr
    assert "dropped the last message and its answer" in err
    assert "error: nothing to undo: the conversation has no message yet" in err
    assert "error: top-p has no effect at temp 0" in err and "top-p set to 0.5" in err
    assert "error: top-k: 'x' is not an integer" in err
    assert "temp 0.8, top-p 0.5, top-k 0, min-p 0.0, max-tokens 6" in err
    assert "/retry" in _chat(tmp_path, lines="/help\n").stderr


def test_generate_takes_the_prompt_as_an_option():
    by_option = runner.invoke(app, ["generate", "-n", "5", "-p", "The import statement"])
    by_argument = runner.invoke(app, ["generate", "-n", "5", "The import statement"])
    assert by_option.exit_code == 0 and by_option.stdout == by_argument.stdout
    assert "give the prompt once" in one_line(runner.invoke(app, ["generate", "-p", "a", "b"]), 2)


def test_cache_ls_as_json(tmp_path):
    result = runner.invoke(app, ["cache", "ls", "--json", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"folder": str(tmp_path), "chains": [], "blocks": 0, "bytes": 0,
                                         "unreadable": 0, "duplicates": 0}


def test_show_describes_a_model():
    result = runner.invoke(app, ["show", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["architecture"] == "llama" and facts["layers"] == 4 and facts["kv_heads"] == 2
    assert facts["head_dim"] == 48 and facts["context"] == 1024 and facts["chat_template"] is True
    assert facts["kv_bytes_per_token"] == 2 * 4 * 2 * 48 * 4  # K and V, 4 layers, 2 heads of 48, float32
    lines = runner.invoke(app, ["show"]).stdout
    assert "kv bytes per token  3072" in lines
    assert one_line(runner.invoke(app, ["show", "/nonexistent/model"]), 1).startswith("error: model not found")


def test_resume_shows_the_history(tmp_path):
    first = _chat(tmp_path, "-n", "4", "--system", "Be brief.", lines="Hello there\n/save trip\n")
    assert first.returncode == 0, first.stderr
    answer = first.stdout.strip()
    resumed = _chat(tmp_path, "-n", "4", "--resume", "trip", lines="/history\n")
    shown = "system: Be brief.\nuser: Hello there\nassistant: " + answer
    assert resumed.stderr.count(shown) == 2, resumed.stderr  # at --resume, then for /history


def test_an_extra_eos_token_ends_the_answer(tmp_path):
    plain = runner.invoke(app, ["generate", "-n", "20", "The import statement"])
    ended = runner.invoke(app, ["generate", "-n", "20", "--extra-eos-token", '"', "The import statement"])
    assert ended.exit_code == 0 and len(ended.stdout) < len(plain.stdout), (plain.stdout, ended.stdout)
    assert "[cut at" in plain.stderr and "[cut at" not in ended.stderr
    chat = _chat(tmp_path, "-n", "20", "--extra-eos-token", '"', lines="Hello\n")
    assert chat.returncode == 0 and chat.stdout.count('"') <= 1 and "cut at" not in chat.stderr  # ends at a quote
    line = one_line(runner.invoke(app, ["generate", "--extra-eos-token", "zzzqqq", "x"]), 1)
    assert line == "error: --extra-eos-token 'zzzqqq' is not a token of this model's vocabulary"
