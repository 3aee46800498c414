"""Sampling controls over HTTP with the official openai client: penalties and logit_bias, logprobs, ``null`` for
optional fields, 16 stop strings, the server's sampling defaults, chat_template_kwargs and the reasoning split."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest
from testkit.archs import build_model
from testkit.models import write_test_model
from testkit.run_config import run_config
from testkit.serve_process import free_port, wait_for_health
from testkit.serve_thread import openai_client, serve_in_thread
from testkit.tokenizer import THINK_END, write_thinking_tokenizer

from mlxkv.config import SamplingDefaults
from mlxkv.engine.batch import EngineConfig
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.output import TextStream
from mlxkv.engine.sampling import SamplingParams
from mlxkv.server.app import create_app
from mlxkv.server.runner import ServerThread

pytestmark = pytest.mark.server

QUESTION = [{"role": "user", "content": "What does the with statement do?"}]


@pytest.fixture(scope="module")
def server(served):
    return served()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.parts.loaded.tokenizer


def chat_ids(tokenizer, messages=QUESTION, **kwargs):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))


def text_of(tokenizer, tokens, max_tokens):
    """The text the server streams for ``tokens`` (stopping at EOS like it does)."""
    stream, out = TextStream(tokenizer, (), max_tokens), []
    for t in tokens:
        text, finish = stream.feed(t)
        out.append(text)
        if finish:
            break
    return "".join(out)


def mlx_lm_text(tokenizer, prompt, max_tokens, **settings):
    """mlx-lm's greedy continuation with its own logits processors, on an unhooked copy of the test llama."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    steps = generate_step(mx.array(prompt), build_model("llama")[0], max_tokens=max_tokens,
                          logits_processors=make_logits_processors(**settings))
    return text_of(tokenizer, [int(t) for t, _ in steps], max_tokens)


def post(server, path, body):
    return httpx.post(server.url + "/v1" + path, json=body, timeout=120)


# ---- penalties and logit_bias -------------------------------------------------------------------------------


def test_penalties_and_logit_bias_change_greedy_output_as_mlx_lm_does(client, tokenizer):
    prompt = chat_ids(tokenizer)
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content == mlx_lm_text(tokenizer, prompt, 20)
    cases = [
        ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
        ({"logit_bias": {"300": 6.0, "301": -100}}, {"logit_bias": {300: 6.0, 301: -100.0}}),
        ({"presence_penalty": -2.0, "extra_body": {"presence_context_size": 40}},  # rewards repeating the prompt
         {"presence_penalty": -2.0, "presence_context_size": 40}),
    ]
    for request, settings in cases:
        got = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=20, temperature=0, **request)
        expected = mlx_lm_text(tokenizer, prompt, 20, **settings)
        assert got.choices[0].message.content == expected != plain.choices[0].message.content, request
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         presence_penalty=2.0)
    assert "".join(c.choices[0].text for c in streamed) == mlx_lm_text(tokenizer, prompt, 12, presence_penalty=2.0)


def test_out_of_range_sampling_fields_get_400_naming_the_field(server):
    base = {"messages": QUESTION, "max_tokens": 2}
    for field, value in [("presence_penalty", 2.1), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"1024": 1}),
                         ("logit_bias", {"-3": 1}), ("top_logprobs", 3), ("repetition_context_size", 0),
                         ("chat_template_kwargs", {"add_generation_prompt": False}), ("logprobs", "yes")]:
        r = post(server, "/chat/completions", {**base, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, r.text
    for value in (21, -1, True):
        r = post(server, "/completions", {"prompt": "x", "logprobs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


# ---- logprobs ------------------------------------------------------------------------------------------------


def teacher_forced(model, prompt, tokens):
    logits = model(mx.array([prompt + tokens]))[0]  # (P + T, vocab)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # (T, vocab)
    return mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()


def test_chat_logprobs_add_up_to_the_teacher_forced_likelihood_and_stream_the_same(server, client, tokenizer):
    prompt = chat_ids(tokenizer)
    r = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=4)
    content = r.choices[0].logprobs.content
    tokens = list(DirectEngine(server.parts.loaded.model, tokenizer).generate_tokens(prompt, SamplingParams(16)))
    forced = teacher_forced(build_model("llama")[0], prompt, tokens)
    assert len(content) == len(tokens) == 16
    assert sum(e.logprob for e in content) == pytest.approx(sum(forced), abs=1e-4)
    # the tokens' bytes are the model's text; mlx-lm's detokenizer drops the space a first token starts with
    assert b"".join(bytes(e.bytes) for e in content).decode().removeprefix(" ") == r.choices[0].message.content
    for entry, token in zip(content, tokens):
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 4 and top == sorted(top, reverse=True)
        assert entry.top_logprobs[0].token == entry.token == tokenizer.decode([token])  # temperature 0: the argmax
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    bare = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * 3
    none = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0)
    assert none.choices[0].logprobs is None


def test_completion_logprobs_take_openai_s_legacy_shape_for_every_choice(client, tokenizer):
    prompt = chat_ids(tokenizer)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9, seed=5, n=2,
                                  logprobs=3)
    for choice in r.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens).removeprefix(" ") == choice.text and len(lp.tokens) == len(lp.token_logprobs) == 10
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == pytest.approx(value) and 3 <= len(top) <= 4  # the sampled token is always there
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0.9, seed=5,
                                              n=2, logprobs=3, stream=True))
    for index, choice in enumerate(r.choices):
        parts = [c.choices[0].logprobs for c in streamed if c.choices[0].index == index and c.choices[0].logprobs]
        assert sum((p.tokens for p in parts), []) == choice.logprobs.tokens
        assert sum((p.text_offset for p in parts), []) == choice.logprobs.text_offset
        assert sum((p.token_logprobs for p in parts), []) == choice.logprobs.token_logprobs


# ---- null, stop lists, server defaults -----------------------------------------------------------------------

OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "user",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "cache_salt", "retention",
            "priority", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs")


def test_null_means_the_default_for_every_optional_field(server):
    base = {"messages": QUESTION, "max_tokens": 6, "seed": 11}
    nulls = {name: None for name in OPTIONAL if name != "seed"}
    for path, body in (("/chat/completions", base),
                       ("/completions", {"prompt": "The with statement", "max_tokens": 6, "seed": 11})):
        extra = dict(nulls) if path == "/chat/completions" else \
            {k: None for k in nulls if k not in ("max_completion_tokens", "top_logprobs", "chat_template_kwargs")}
        if path == "/completions":
            extra["echo"] = None
        with_nulls = post(server, path, {**body, **extra})
        without = post(server, path, body)
        assert with_nulls.status_code == 200, with_nulls.text
        assert with_nulls.json()["choices"] == without.json()["choices"]  # seeded at the default temperature 1.0
    assert post(server, "/chat/completions", {"messages": None}).status_code == 400  # required stays required


def test_sixteen_stop_strings_are_honoured_and_seventeen_refused(client, server):
    full = client.completions.create(model="tiny", prompt="The with statement", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[10:13]
    stops = [f"never-{i}" for i in range(15)] + [stop]
    cut = client.completions.create(model="tiny", prompt="The with statement", max_tokens=24, temperature=0,
                                    stop=stops)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    r = post(server, "/completions", {"prompt": "x", "stop": stops + ["one more"]})
    assert r.status_code == 400 and "16" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def defaults_server(server):
    """A second app over the same engine with server-wide defaults (``mlxkv serve --temp 0 --max-tokens 7 ...``)."""
    defaults = SamplingDefaults(temp=0.0, max_tokens=7, repetition_penalty=1.8, top_k=3)
    app = create_app(server.parts.engine, model_name="tiny", defaults=defaults)
    with ServerThread(app) as srv:
        client = openai_client(srv.url, timeout=120)
        client.root_url = srv.url
        yield client


def test_server_defaults_apply_unless_the_request_sets_its_own(defaults_server, client, tokenizer):
    prompt = chat_ids(tokenizer)
    got = defaults_server.chat.completions.create(model="tiny", messages=QUESTION)
    assert got.usage.completion_tokens == 7
    assert got.choices[0].message.content == mlx_lm_text(tokenizer, prompt, 7, repetition_penalty=1.8)
    own = defaults_server.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0,
                                                  extra_body={"repetition_penalty": 1.0})
    plain = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0)
    assert own.choices[0].message.content == plain.choices[0].message.content
    nulls = defaults_server.completions.create(model="tiny", prompt="x", temperature=None, max_tokens=None)
    assert nulls.usage.completion_tokens == 7  # null is "not set": the server's default again


def test_the_messages_route_takes_the_server_defaults_too(defaults_server, tokenizer):
    """``/v1/messages`` with no temperature runs at the server's temperature and penalty, as chat does."""
    import anthropic

    client = anthropic.Anthropic(base_url=defaults_server.root_url, api_key="unused", max_retries=0)
    message = client.messages.create(model="tiny", max_tokens=7, messages=QUESTION)
    assert message.content[0].text == mlx_lm_text(tokenizer, chat_ids(tokenizer), 7, repetition_penalty=1.8)


# ---- chat_template_kwargs and reasoning ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A server over the test llama with a thinking tokenizer (think markers, a template that opens a think block
    unless ``enable_thinking`` is false), and a second app over its engine defaulting ``enable_thinking`` off."""
    folder = write_test_model("llama", tmp_path_factory.mktemp("thinking"))
    write_thinking_tokenizer(folder)
    with serve_in_thread(run_config(str(folder), engine=EngineConfig(max_sequences=2), kv_backend="paged")) as srv:
        off = create_app(srv.parts.engine, model_name="t",
                         defaults=SamplingDefaults(chat_template_kwargs={"enable_thinking": False}))
        with ServerThread(off) as srv_off:
            tokenizer = srv.parts.loaded.tokenizer
            yield {"on": openai_client(srv.url, api_key="-", timeout=120),
                   "off": openai_client(srv_off.url, api_key="-", timeout=120),
                   "tokenizer": tokenizer, "end_id": tokenizer.think_end_id}


BIAS = 2.5  # on </think>: enough for the test llama to close its think block within 12 tokens, not at once


def prompt_of(thinking, **template_kwargs):
    return list(thinking["tokenizer"].apply_chat_template(QUESTION, add_generation_prompt=True, **template_kwargs))


def raw_text(thinking, **template_kwargs):
    """The model's greedy output for QUESTION, markers and all (through /v1/completions on the rendered prompt)."""
    r = thinking["on"].completions.create(model="t", prompt=prompt_of(thinking, **template_kwargs), max_tokens=12,
                                          temperature=0, logit_bias={str(thinking["end_id"]): BIAS})
    return r.choices[0].text


def chat(client, thinking, **extra):
    return client.chat.completions.create(model="t", messages=QUESTION, max_tokens=12, temperature=0,
                                          logit_bias={str(thinking["end_id"]): BIAS}, **extra)


def test_think_blocks_go_to_reasoning_content_streaming_or_not(thinking):
    raw = raw_text(thinking)  # the template opened a think block: the output starts inside it
    assert raw.count(THINK_END) == 1
    reasoning, content = raw.split(THINK_END)
    assert reasoning and content
    message = chat(thinking["on"], thinking).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    chunks = list(chat(thinking["on"], thinking, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert any(getattr(d, "reasoning_content", None) for d in deltas[:3])  # streamed as it came, not at the end


def test_chat_template_kwargs_per_request_and_as_the_server_default(thinking):
    off_raw = raw_text(thinking, enable_thinking=False)  # an empty think block in the prompt: all is content
    assert THINK_END not in off_raw
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    per_request = chat(thinking["on"], thinking, extra_body=off)
    by_default = chat(thinking["off"], thinking)  # mlxkv serve --chat-template-kwargs '{"enable_thinking": false}'
    for r in (per_request, by_default):
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, off_raw)
        assert r.usage.prompt_tokens == len(prompt_of(thinking, enable_thinking=False))
    wins = chat(thinking["off"], thinking, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert wins.choices[0].message == chat(thinking["on"], thinking).choices[0].message  # the request's key wins
    assert wins.usage.prompt_tokens == len(prompt_of(thinking)) < by_default.usage.prompt_tokens


def test_the_prompt_memo_keys_on_the_rendering_so_template_kwargs_never_mix(test_model_dir):
    """A template variable that changes how the shared system prompt renders: prompts alternating it each equal the
    template's own ids, and both renderings of the head are memoized and reused."""
    from mlx_lm.utils import load_tokenizer
    from testkit.tokenizer import CHAT_TEMPLATE

    from mlxkv.server.prompts import PromptEncoder

    tok = load_tokenizer(test_model_dir("llama"))
    tok._tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{{ message['content'] }}", "{% if loud is defined and loud %}{{ message['content'] | upper }}"
                                    "{% else %}{{ message['content'] }}{% endif %}")
    encoder = PromptEncoder(tok, min_head_chars=64)
    system = "You are a careful assistant. " * 10
    for i in range(6):
        kwargs = {"loud": i % 2 == 1}
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
        assert encoder.chat(messages, **kwargs) == ids
    assert encoder.hits == 2 and encoder.memo_on  # each rendering: met, checked, then reused


@pytest.mark.parametrize("pieces, starts_in, expected", [
    (["abc</th", "ink>def"], True, ("abc", "def")),
    (["<think>x</think>y"], False, ("x", "y")),
    (["a</", "b", "</think>", "c"], True, ("a</b", "c")),  # a held prefix that is not a marker after all
    (["hi <thi", "nk>deep", " thought</think> ok <think>again</think>!"], False, ("deep thoughtagain", "hi  ok !")),
    (["<", "t", "h", "i", "n", "k", ">", "r", "<", "/think>", "c"], False, ("r", "c")),  # one character at a time
    (["unfinished </thi"], True, ("unfinished </thi", "")),  # held text is flushed where it was
])
def test_the_reasoning_splitter_finds_markers_across_streamed_pieces(pieces, starts_in, expected):
    from mlxkv.server.reasoning import ReasoningSplitter

    splitter = ReasoningSplitter("<think>", "</think>", reasoning=starts_in)
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected
    assert all("<think>" not in r + c and "</think>" not in r + c for r, c in parts)


def test_serve_options_set_the_server_defaults(test_model_dir, client):
    """``mlxkv serve --temp 0 --max-tokens 5 --repetition-penalty 1.8 --chat-template-kwargs ...`` as a process: a
    request that sets nothing gets them; bad values fail before the model loads."""
    import os
    import signal
    import subprocess
    import sys

    import typer
    from typer.testing import CliRunner

    from mlxkv.cli.serve import serve

    app = typer.Typer()
    app.command()(serve)
    for args, hint in ((["--chat-template-kwargs", "{not json"], "not valid JSON"),
                       (["--chat-template-kwargs", '{"tokenize": true}'], "tokenize"),
                       (["--repetition-penalty", "0"], "repetition_penalty")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and hint in result.output, result.output
    port = free_port()
    cmd = [sys.executable, "-m", "mlxkv.server", "--model", str(test_model_dir("llama")), "--port", str(port),
           "--max-sequences", "2", "--log-level", "warning", "--temp", "0", "--max-tokens", "5",
           "--repetition-penalty", "1.8", "--chat-template-kwargs", '{"enable_thinking": false}']
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, proc, timeout=60)
        r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION}, timeout=60).json()
        expected = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0,
                                                  extra_body={"repetition_penalty": 1.8})
        assert r["usage"]["completion_tokens"] == 5
        assert r["choices"][0]["message"]["content"] == expected.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
