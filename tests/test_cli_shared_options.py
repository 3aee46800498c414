"""One source of options: what ``generate``, ``chat`` and ``serve`` share is one definition, refused by one rule.

Read from the Typer commands themselves: every option two commands have in common has the same flags, type,
default and help in each (the differences are listed here, each with its reason), the same bad value is refused
with the same message by every command that has the option, and the config dataclass that holds the value refuses
it too, in the same words.
"""

from __future__ import annotations

import typing

import pytest
import typer
from mlxkv import rules
from mlxkv.cli import shared_options
from mlxkv.cli.main import app
from mlxkv.config import KvCacheConfig, KvOverflowConfig, SamplingDefaults
from typer.testing import CliRunner

runner = CliRunner()
COMMANDS = ("generate", "chat", "serve")

#: Options that share a flag but not a meaning: (command, parameter) -> why.
DIFFERENT_MEANING = {
    ("chat", "max_kv_size"): "chat's is the conversation's context limit (older turns are dropped), not a rotating "
                             "per-layer cap",
    ("chat", "max_tokens"): "a chat answer's cap: a longer default (512) than a completion's, and its help says "
                            "a cut answer is marked",
    ("chat", "kv_overflow"): "chat's cache is dense (no pages to evict) and h2o/offload caches cannot be /saved: "
                             "the help says so",
    ("serve", "model"): "serve's is repeatable ([NAME=]MODEL): several models behind one server",
}


def _params() -> dict[str, dict[str, typing.Any]]:
    group = typer.main.get_command(app)
    return {name: {p.name: p for p in group.commands[name].params if p.name != "prompt"} for name in COMMANDS}


def _type(param) -> object:
    """The value type a parameter is declared with (``Optional[int]`` -> ``int``: serve's default may be None)."""
    annotation = param.type_descriptor.annotation
    inner = [a for a in typing.get_args(annotation) if a is not type(None)]
    return inner[0] if typing.get_origin(annotation) is typing.Union and len(inner) == 1 else annotation


def _shared() -> dict[str, list[str]]:
    """Each parameter two or more commands have -> those commands."""
    params = _params()
    found: dict[str, list[str]] = {}
    for command in COMMANDS:
        for name in params[command]:
            found.setdefault(name, []).append(command)
    return {name: commands for name, commands in found.items() if len(commands) > 1}


def test_the_commands_share_the_options_they_have_in_common():
    assert set(_shared()) >= {"model", "revision", "dequantize", "chat_template", "max_tokens", "temp", "top_p",
                              "top_k", "min_p", "kv_bits", "kv_group_size", "kv_overflow", "kv_overflow_budget",
                              "kv_overflow_sinks", "kv_overflow_recent", "kv_backend", "kv_block_size",
                              "state_snapshot_interval", "max_kv_size", "seed", "stop", "system", "verbose",
                              "distributed"}


@pytest.mark.parametrize("name", sorted(_shared()))
def test_a_shared_option_has_one_name_type_default_and_help(name):
    params = _params()
    described, defaults = {}, {}
    for command in _shared()[name]:
        if (command, name) in DIFFERENT_MEANING:
            continue
        p = params[command][name]
        described[command] = (tuple(p.opts), tuple(p.secondary_opts), _type(p), p.help, p.metavar,
                              getattr(p.callback, "__wrapped__", p.callback),
                              p.rich_help_panel)
        if command == "serve" and name in shared_options.SERVE_DEFAULTS:
            assert p.default == shared_options.SERVE_DEFAULTS[name]
        else:
            defaults[command] = p.default
    assert len(described) >= 2 and len(set(described.values())) == 1, described
    assert len(set(defaults.values())) <= 1, defaults


def test_serve_defaults_differ_only_where_listed():
    params = _params()
    differ = {name for name in shared_options.SERVE_DEFAULTS
              if params["serve"][name].default != params["generate"][name].default}
    assert differ == set(shared_options.SERVE_DEFAULTS)


#: A bad value of a shared option, and the config dataclass (built directly) that must refuse it.
BAD = [
    (["--temp", "2.5"], lambda: SamplingDefaults(temp=2.5)),
    (["--temp", "-1"], lambda: SamplingDefaults(temp=-1.0)),
    (["--top-p", "1.5"], lambda: SamplingDefaults(top_p=1.5)),
    (["--top-p", "0"], lambda: SamplingDefaults(top_p=0.0)),
    (["--min-p", "1"], lambda: SamplingDefaults(min_p=1.0)),
    (["--top-k", "-1"], lambda: SamplingDefaults(top_k=-1)),
    (["--max-tokens", "0"], lambda: SamplingDefaults(max_tokens=0)),
    (["--kv-bits", "3"], lambda: KvCacheConfig(kv_bits=3)),
    (["--kv-group-size", "48"], lambda: KvCacheConfig(kv_group_size=48)),
    (["--kv-backend", "sparse"], lambda: KvCacheConfig(backend="sparse")),
    (["--kv-block-size", "12"], lambda: KvCacheConfig(block_size=12)),
    (["--max-kv-size", "4"], lambda: KvCacheConfig(max_kv_size=4)),
    (["--state-snapshot-interval", "-1"], lambda: KvCacheConfig(state_snapshot_interval=-1)),
    (["--kv-overflow", "lru"], lambda: KvOverflowConfig(policy="lru")),
    (["--kv-overflow-budget", "1"], lambda: KvOverflowConfig(policy="window", budget=1, sinks=0)),
    (["--kv-overflow-sinks", "-1"], lambda: KvOverflowConfig(policy="window", budget=64, sinks=-1)),
    (["--kv-overflow-recent", "0"], lambda: KvOverflowConfig(policy="h2o", budget=64, recent=0)),
]


def _refusal(command: str, args: list[str]) -> str:
    result = runner.invoke(app, [command, *args] + (["hello"] if command == "generate" else []))
    assert result.exit_code == 2, (command, args, result.output)
    flat = " ".join(result.output.replace("│", " ").replace("╰", " ").replace("─", " ").replace("╯", " ").split())
    assert "Invalid value for" in flat, flat
    return flat[flat.index("Invalid value for"):]


@pytest.mark.parametrize("args, build", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_refused_alike_by_every_command_and_by_the_config(args, build, monkeypatch):
    import mlxkv.models

    monkeypatch.setattr(mlxkv.models, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    name = args[0].lstrip("-").replace("-", "_")
    commands = [c for c in _shared()[name] if (c, name) not in DIFFERENT_MEANING]
    assert len(commands) >= 2, commands
    messages = {command: _refusal(command, args) for command in commands}
    assert len(set(messages.values())) == 1, messages
    message = next(iter(messages.values()))
    with pytest.raises(ValueError) as refused:
        build()
    why = str(refused.value).partition(": ")[2].replace("one of None, ", "one of ")  # a field may be None
    assert why and message.endswith(why), (message, str(refused.value))


def test_the_temperature_rule_is_openais_range_everywhere():
    assert (rules.TEMP.low, rules.TEMP.high) == (0.0, 2.0)
    for command in COMMANDS:
        assert "it must be less than or equal to 2" in _refusal(command, ["--temp", "2.5"])
    SamplingDefaults(temp=2.0)
    with pytest.raises(ValueError, match="temp: 2.5 is not in the range 0<=x<=2"):
        SamplingDefaults(temp=2.5)
