"""Tool calls read from generated text: scripted model outputs, tokenized by real tokenizers and turned back into
text token by token exactly as the engine does (``TextStream``), through :class:`ToolOutput` / ``ToolCallParser``
(mlx-lm's json_tools parser and TextStateMachine). Also the request side (history, tool_choice) and the streamed
chunks as the official openai client accumulates them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.real_model import GGUF
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from mlxkv.chat_template import read_chat_template, tool_parser_names, with_chat_template
from mlxkv.engine.output import Event, TextStream
from mlxkv.server.responses import ResponseBuilder
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.tools import (
    ToolCallParser,
    ToolRequestError,
    check_template_renders_tools,
    render_tools,
    to_template_messages,
    tools_in_use,
)

TEMPLATE = Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module", params=["test-tokenizer", pytest.param("smollm2", marks=pytest.mark.real_model)])
def tokenizer(request, test_model_dir):
    """A real tokenizer with the tools template: the test llama's byte-level BPE, and SmolLM2's (from its GGUF)."""
    if request.param == "smollm2":
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from mlxkv.gguf.reader import read
        from mlxkv.gguf.tokenizer import build_tokenizer

        meta = read(GGUF).metadata
        base = TokenizerWrapper(build_tokenizer(meta))
    else:
        from mlx_lm.utils import load_tokenizer

        base = load_tokenizer(test_model_dir("llama"))
    assert not base.has_tool_calling
    return with_chat_template(base, read_chat_template(TEMPLATE))


def generate(tokenizer, script: str, *, max_tokens: int = 10_000, parallel: bool = True, streaming: bool = False):
    """Run ``script`` (the model's output, then EOS) through the engine's TextStream and one choice's ToolOutput:
    ``(content, calls, finish_reason)`` with every content piece and call as they came out."""
    ids = list(tokenizer.encode(script, add_special_tokens=False)) + [next(iter(tokenizer.eos_token_ids))]
    stream = TextStream(tokenizer, (), max_tokens)
    out = ToolOutput(tokenizer, [WEATHER], 1, parallel=parallel, streaming=streaming)
    pieces, calls, reason = [], [], None
    for token in ids:
        text, finish = stream.feed(token)
        content, made, reason = out.feed(0, text, finish)
        pieces.append(content)
        calls += made
        if finish:
            break
    return pieces, calls, reason


def test_the_tools_template_picks_mlx_lm_s_json_tools_parser(tokenizer):
    assert tokenizer.has_tool_calling and tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert check_template_renders_tools(tokenizer) is None


def test_text_then_a_call(tokenizer):
    pieces, calls, reason = generate(tokenizer, "Let me look that up.\n" + call_text("get_weather", {"city": "Paris"}))
    assert "".join(pieces) == "Let me look that up."  # the blank line before the call is not content
    assert all("<" not in p for p in pieces)  # no markup, not even a held-back prefix, ever reached the content
    assert reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_two_calls_then_text_and_parallel_false_keeps_the_first(tokenizer):
    script = (call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_weather", {"city": "Oslo"})
              + "\nBoth asked.")
    pieces, calls, reason = generate(tokenizer, script, streaming=True)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"]
    assert [c["index"] for c in calls] == [0, 1] and len({c["id"] for c in calls}) == 2
    assert "".join(pieces) == "\nBoth asked." and reason == "tool_calls"
    _, first_only, _ = generate(tokenizer, script, parallel=False)
    assert [json.loads(c["function"]["arguments"])["city"] for c in first_only] == ["Paris"]


@pytest.mark.parametrize("script", [
    "A plain answer with no call at all.",
    "Comparisons use < and > and even <tool_ or <tool_cal without closing.",
    "Trailing spaces and a newline stay.  \n",
])
def test_text_without_calls_comes_through_unchanged(tokenizer, script):
    pieces, calls, reason = generate(tokenizer, script)
    assert "".join(pieces) == tokenizer.decode(tokenizer.encode(script, add_special_tokens=False))
    assert calls == [] and reason == "stop"


def test_a_call_that_does_not_parse_is_content_and_a_cut_off_one_is_dropped(tokenizer):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    pieces, calls, reason = generate(tokenizer, "Hmm. " + bad)
    assert calls == [] and reason == "stop" and "".join(pieces) == "Hmm. " + bad
    script = "Sure. " + call_text("get_weather", {"city": "Paris"})
    ids = tokenizer.encode(script, add_special_tokens=False)
    cut = max(k for k in range(len(ids)) if "Paris" not in tokenizer.decode(ids[:k]))  # stopped inside the JSON
    pieces, calls, reason = generate(tokenizer, script, max_tokens=cut)
    assert calls == [] and reason == "length" and "<tool_call>" in tokenizer.decode(ids[:cut])
    assert "".join(pieces) == "Sure."  # no markup, nor the blank before it
    for k in range(len(ids)):  # cut anywhere in the call, even inside its start marker: never markup
        pieces, _, _ = generate(tokenizer, script, max_tokens=k + 1)
        assert "<" not in "".join(pieces) and "tool_call" not in "".join(pieces), (k, pieces)


def test_a_call_without_its_end_marker_still_reads_when_its_text_is_whole(tokenizer):
    pieces, calls, reason = generate(tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert "".join(pieces) == "" and reason == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_chunking_of_the_text_gives_the_same_content_and_calls(cuts):
    """The engine hands text over in pieces of any size (a token, a burst of a step): only the result counts."""
    from types import SimpleNamespace

    from mlx_lm.tool_parsers import json_tools

    tok = SimpleNamespace(has_tool_calling=True, tool_parser=json_tools.parse_tool_call,
                          tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end)
    text = ("Checking <b>both</b>. " + call_text("get_weather", {"city": "Paris"}) + " and "
            + call_text("get_weather", {"city": "Köln"}) + " <tool_ done.")
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = ToolCallParser(tok, [WEATHER])
    content, calls = "", []
    for a, b in zip(bounds, bounds[1:]):
        piece, made = parser.feed(text[a:b])
        content, calls = content + piece, calls + made
    piece, made = parser.finish()
    content, calls = content + piece, calls + made
    assert content == "Checking <b>both</b>. and <tool_ done."  # the spaces before each call separate it
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Köln"}]


def test_the_openai_client_rebuilds_streamed_calls_from_our_chunks(tokenizer):
    """Our SSE chunks for a scripted answer, fed to the official client's stream accumulator."""
    from mlxkv.server.app import _render
    from mlxkv.server.choice_output import ChoiceOutput

    script = "On it." + call_text("get_weather", {"city": "Paris"}) + call_text("get_weather", {"city": "Lima"})
    ids = list(tokenizer.encode(script, add_special_tokens=False)) + [next(iter(tokenizer.eos_token_ids))]
    stream = TextStream(tokenizer, (), 10_000)
    outputs = [ChoiceOutput(tools=ToolOutput(tokenizer, [WEATHER], 1, streaming=True))]
    builder = ResponseBuilder(chat=True, model="m", system_fingerprint="fp_0123456789")
    events = [builder.role_chunk(0)]
    for token in ids:
        text, finish = stream.feed(token)
        out: list[str] = []
        _render(Event("token", 0, text, token, finish), builder, outputs, False, out)
        events += [json.loads(e.removeprefix("data: ")) for e in out]
    state = ChatCompletionStreamState()
    for e in events:
        assert e["system_fingerprint"] == "fp_0123456789"
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "On it."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lima"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in final.message.tool_calls)


def test_history_arguments_become_dicts_and_tool_results_get_the_function_name():
    messages = to_template_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "-3 C"},
    ])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_a", "name": "get_weather"},
    ]
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(ToolRequestError) as exc:
            to_template_messages([{"role": "assistant", "tool_calls": [
                {"id": "c", "function": {"name": "f", "arguments": bad}}]}])
        assert exc.value.param == "messages.0.tool_calls.0.function.arguments"


def test_tool_choice_none_auto_and_the_forced_kinds():
    assert tools_in_use([WEATHER], None) and tools_in_use([WEATHER], "auto")
    assert not tools_in_use([WEATHER], "none") and not tools_in_use([], "auto") and not tools_in_use(None, None)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for choice in ("required", "any", {"type": "function", "function": {"name": "get_weather"}}):
        assert tools_in_use([WEATHER, strict], choice)  # forced by constrained decoding (structured_output.py)
        with pytest.raises(ToolRequestError, match="needs tools") as exc:
            tools_in_use([], choice)
        assert exc.value.param == "tool_choice"
    with pytest.raises(ToolRequestError, match="'get_time', which is not among the tools") as exc:
        tools_in_use([WEATHER], {"type": "function", "function": {"name": "get_time"}})
    assert exc.value.param == "tool_choice"
    assert render_tools([{"type": "function", "function": {"name": "f", "description": None, "strict": False}}]) \
        == [{"type": "function", "function": {"name": "f"}}]


def test_templates_without_tools_are_told_apart(test_model_dir):
    from mlx_lm.utils import load_tokenizer

    plain = load_tokenizer(test_model_dir("llama"))
    assert "no tool-call format" in check_template_renders_tools(plain)
    forced = with_chat_template(plain, tool_parser="json_tools")  # a parser, but the template ignores tools
    assert forced.has_tool_calling and "ignores tools" in check_template_renders_tools(forced)
    assert plain.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == \
        forced.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_template_files_and_parser_names_are_checked(tmp_path):
    assert {"json_tools", "qwen3_coder", "mistral", "pythonic"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="unknown tool parser 'nope': expected one of .*json_tools"):
        with_chat_template(object(), tool_parser="nope")
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(tmp_path / "missing.jinja")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(tmp_path / "empty.jinja")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        read_chat_template(tmp_path / "broken.jinja")


def test_a_call_repeated_verbatim_is_given_once(tokenizer):
    paris, rome = call_text("get_weather", {"city": "Paris"}), call_text("get_weather", {"city": "Rome"})
    respelled = '<tool_call>\n{"arguments": {"city":"Paris"}, "name": "get_weather"}\n</tool_call>'
    _, calls, reason = generate(tokenizer, "\n".join([paris, rome, paris, respelled]))
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert reason == "tool_calls"
