"""``mlxkv serve --prompt-lookup``: speculative decoding through the official clients, on the random-weight test
llama. Greedy output equals a server without speculation token for token — concurrent requests verified in one
batched forward (paged), quantized pages and the dense store (one forward per row), ``n > 1``, stop strings,
penalties and ``logit_bias``, structured output and forced tool calls (all of these speculating), ``logprobs``,
preemption and resume, a cancelled neighbour — while proposals are both accepted and rejected; the ``speculative`` request field on every route; the counts in
``usage``, ``/metrics`` and ``/v1/cache/stats``; the one-line refusals."""

import json

import httpx
import pytest
from testkit.archs import build_from_config, get_config
from testkit.models import write_model
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread
from testkit.speculative_requests import complete, speculative_usage, texts, together

pytestmark = [pytest.mark.float_order, pytest.mark.server]

K = 4


def cycle(a):
    """A prompt of ``a, a+1, a+2`` repeated: prompt lookup proposes its continuation."""
    return [a, a + 1, a + 2] * 8


# Token prompts after which the test llama's greedy output repeats itself in part (lookups both accepted and
# rejected), and one whose output barely repeats.
PROMPTS = [cycle(73), cycle(192), cycle(122), list(range(10, 40))]
WIDE_PROMPTS = [cycle(220), cycle(234), cycle(318), cycle(94)]  # the same for the head_dim-32 llama below


@pytest.fixture(scope="module")
def plain(served):
    return openai_client(served().url)


@pytest.fixture(scope="module")
def spec_server(served):
    return served(prompt_lookup=True, num_draft_tokens=K)


@pytest.fixture(scope="module")
def spec(spec_server):
    return openai_client(spec_server.url)


def test_concurrent_greedy_requests_equal_plain_decoding_and_proposals_are_accepted_and_rejected(plain, spec,
                                                                                                  spec_server):
    expected = [texts(r) for r in together(plain, PROMPTS)]
    before = spec_server.parts.engine.stats()["speculative"]
    got = together(spec, PROMPTS)
    assert [texts(r) for r in got] == expected
    used = [speculative_usage(r) for r in got]
    assert all(u is not None for u in used)
    proposed, accepted = sum(u["proposed_tokens"] for u in used), sum(u["accepted_tokens"] for u in used)
    assert 0 < accepted < proposed, used  # both paths of the verification ran
    stats = spec_server.parts.engine.stats()["speculative"]
    assert stats["draft_tokens"] - before["draft_tokens"] == proposed
    assert stats["accepted_tokens"] - before["accepted_tokens"] == accepted
    assert stats["tokens_per_forward"] > 1.0
    totals = spec_server.parts.engine.stats()
    assert totals["batched_verify_steps_total"] > 0  # ragged rows in one forward (paged, full attention)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """The test llama with head_dim 32 (2 heads of hidden 64): quantization groups of 32 divide it, and its
    greedy output accepts a few lookups of the prompts above."""
    config = {**get_config("llama"), "num_attention_heads": 2, "num_key_value_heads": 1}
    return write_model(*build_from_config(config), tmp_path_factory.mktemp("wide-llama"))


def equal_outputs(plain, spec, prompts=PROMPTS):
    expected = [texts(r) for r in together(plain, prompts)]
    got = together(spec, prompts)
    assert [texts(r) for r in got] == expected
    assert sum(speculative_usage(r)["accepted_tokens"] for r in got) > 0


def test_quantized_pages_equal_plain_decoding(wide_llama):
    """--kv-bits 8: the verification rows run one forward each (batched prefill views take unquantized K/V)."""
    options = dict(kv_backend="paged", kv_bits=8, kv_group_size=32)
    with serve_in_thread(run_config(str(wide_llama), **options)) as plain_srv, \
            serve_in_thread(run_config(str(wide_llama), prompt_lookup=True, num_draft_tokens=K, **options)) as srv:
        equal_outputs(openai_client(plain_srv.url), openai_client(srv.url), WIDE_PROMPTS)
        assert srv.parts.engine.stats()["unbatched_verify_steps_total"] > 0


def test_the_dense_store_equals_plain_decoding(served):
    equal_outputs(openai_client(served(kv_backend="dense").url),
                  openai_client(served(kv_backend="dense", prompt_lookup=True, num_draft_tokens=K).url))


def test_n_stop_penalties_bias_and_logprobs_keep_their_output(plain, spec):
    prompt = PROMPTS[0]
    expected = complete(plain, prompt, n=2, max_tokens=30)
    got = complete(spec, prompt, n=2, max_tokens=30)
    assert texts(got) == texts(expected) and len(set(texts(got))) == 1  # greedy: both choices the same
    assert speculative_usage(got)["accepted_tokens"] > 0
    full = texts(complete(plain, prompt, max_tokens=40))[0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert texts(complete(spec, prompt, stop=[stop]))[0] == texts(complete(plain, prompt, stop=[stop]))[0]
    expected = complete(plain, prompt, logprobs=2)
    got = complete(spec, prompt, logprobs=2)
    assert texts(got) == texts(expected)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(expected.choices[0].logprobs.token_logprobs,
                                                                   abs=1e-4)


# Penalties and biases that change the output while it still repeats its prompt in part.
PROCESSED = [{"presence_penalty": 0.5}, {"frequency_penalty": 0.3},
             {"extra_body": {"repetition_penalty": 1.1}},
             {"extra_body": {"repetition_penalty": 1.3, "repetition_context_size": 8}},
             {"logit_bias": {"17": 5, "40": -100}}, {"logit_bias": {"73": 2, "74": -3, "193": -2}}]


@pytest.mark.parametrize("extra", PROCESSED, ids=lambda e: "-".join(sorted({**e, **e.get("extra_body", {})})))
def test_penalised_and_biased_rows_speculate_and_keep_their_output(plain, spec, extra):
    """Each verification position sees its penalties over the history extended by the draft tokens before it, as
    plain decoding would have: equal output, with proposals accepted and rejected over the prompts."""
    expected = [texts(r) for r in together(plain, PROMPTS[:3], **extra)]
    assert expected != [texts(r) for r in together(plain, PROMPTS[:3])]  # the processors act
    got = together(spec, PROMPTS[:3], **extra)
    assert [texts(r) for r in got] == expected
    used = [speculative_usage(r) for r in got]
    proposed, accepted = sum(u["proposed_tokens"] for u in used), sum(u["accepted_tokens"] for u in used)
    assert 0 < accepted < proposed, used


def test_structured_output_and_the_request_field(plain, spec):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    messages = [{"role": "user", "content": "give a"}]
    expected = plain.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                             response_format=fmt)
    got = spec.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                       response_format=fmt)
    assert got.choices[0].message.content == expected.choices[0].message.content
    json.loads(got.choices[0].message.content)
    prompt = PROMPTS[0]
    off = complete(spec, prompt, extra_body={"speculative": False})
    assert speculative_usage(off) is None and texts(off) == texts(complete(plain, prompt))
    two = complete(spec, prompt, extra_body={"speculative": {"num_draft_tokens": 1}})
    assert texts(two) == texts(off)
    used = speculative_usage(two)
    assert 0 < used["proposed_tokens"] <= 40 and used["accepted_tokens"] > 0
    with pytest.raises(Exception) as bad:
        complete(spec, prompt, extra_body={"speculative": {"num_draft_tokens": 0}})
    assert bad.value.status_code == 400


QUOTED = {"type": "object", "properties": {
    "name": {"enum": ["the quick brown fox jumps over the lazy dog", "a slow green turtle"]},
    "note": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "note", "count"], "additionalProperties": False}


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.3}], ids=["greedy", "penalised"])
def test_structured_output_speculates_with_the_plain_tokens(plain, spec, spec_server, extra):
    """A schema whose output quotes the prompt: proposals are cut where the grammar refuses, every position is
    verified under its grammar mask, the accepted tokens advance the grammar; the documents equal plain decoding's
    and proposals are both accepted and rejected."""
    fmt = {"type": "json_schema", "json_schema": {"name": "q", "schema": QUOTED}}
    quoted = '{"name": "the quick brown fox jumps over the lazy dog", "note": "x", "count": 3}'
    prompts = [f"copy this: {quoted} {quoted}", f"name the fox: {quoted}", "a slow green turtle " * 3]
    kw = dict(max_tokens=60, temperature=0, extra_body={"response_format": fmt}, **extra)
    expected = [texts(r) for r in together(plain, prompts, **kw)]
    got = together(spec, prompts, **kw)
    assert [texts(r) for r in got] == expected
    for (text,) in expected:
        json.loads(text)  # whole documents of the schema (the limit is not reached)
    used = [speculative_usage(r) for r in got]
    proposed, accepted = sum(u["proposed_tokens"] for u in used), sum(u["accepted_tokens"] for u in used)
    assert 0 < accepted < proposed, used
    # rejection sampling under the masks (room for a note of 12 multi-byte characters, a few tokens each)
    sampled = together(spec, prompts, **{**kw, "temperature": 0.8, "max_tokens": 120})
    for r in sampled:
        assert json.loads(texts(r)[0])["name"] in QUOTED["properties"]["name"]["enum"]
    assert sum(speculative_usage(r)["accepted_tokens"] for r in sampled) > 0


def test_a_forced_tool_call_speculates_with_the_plain_call(served):
    """``tool_choice`` naming a function: its call's grammar is verified like a schema's; the prompt (the rendered
    tools and a call in the conversation) holds the text the call repeats."""
    from pathlib import Path

    template = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": 'Call {"name": "get_weather", "arguments": {"city": "Oslo"}} now.'}]
    kw = dict(model="m", messages=messages, tools=[weather], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    expected = openai_client(served(chat_template=template).url).chat.completions.create(**kw)
    got = openai_client(served(chat_template=template, prompt_lookup=True, num_draft_tokens=K).url
                        ).chat.completions.create(**kw)
    calls = [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in expected.choices[0].message.tool_calls]
    assert calls[0][0] == "get_weather"
    assert speculative_usage(got)["accepted_tokens"] > 0


def test_a_server_without_a_drafter_refuses_the_field_on_every_route(served):
    srv = served()
    client = openai_client(srv.url)
    field = {"speculative": {"num_draft_tokens": 2}}
    calls = [
        lambda: complete(client, [1, 2, 3], extra_body=field),
        lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               extra_body=field),
        lambda: client.responses.create(model="m", input="hi", extra_body=field),
        lambda: anthropic_client(srv.url).messages.create(model="m", max_tokens=4, extra_body=field,
                                                          messages=[{"role": "user", "content": "hi"}]),
    ]
    for call in calls:
        with pytest.raises(Exception) as refused:
            call()
        assert refused.value.status_code == 400
        assert "speculative" in str(refused.value)
    assert texts(complete(client, [1, 2, 3], max_tokens=2, extra_body={"speculative": False}))  # off: honoured


def test_usage_on_the_other_routes_and_metrics(spec_server, spec):
    chat = spec.chat.completions.create(model="m", messages=[{"role": "user", "content": "ab ab ab ab ab ab"}],
                                        max_tokens=20, temperature=0)
    assert set(speculative_usage(chat)) == {"proposed_tokens", "accepted_tokens"}
    message = anthropic_client(spec_server.url).messages.create(
        model="m", max_tokens=20, messages=[{"role": "user", "content": "ab ab ab ab ab"}])
    assert "proposed_tokens" in message.usage.model_extra["speculative"]
    response = spec.responses.create(model="m", input="ab ab ab ab", max_output_tokens=20, temperature=0)
    assert "accepted_tokens" in response.usage.model_extra["speculative"]
    metrics = httpx.get(spec_server.url + "/metrics").text
    for name in ("mlxkv_speculative_draft_tokens_total", "mlxkv_speculative_accepted_tokens_total",
                 "mlxkv_speculative_acceptance_rate", "mlxkv_decode_tokens_per_forward"):
        assert name in metrics, name
    stats = httpx.get(spec_server.url + "/v1/cache/stats").json()["speculative"]
    assert stats["enabled"] and stats["num_draft_tokens"] == K and 0 < stats["acceptance_rate"] < 1


def test_preemption_and_a_cancelled_neighbour_keep_greedy_output(served, plain):
    """A KV budget that holds about two of the four sequences: rows are preempted mid-speculation and resume."""
    expected = [texts(r) for r in together(plain, PROMPTS, max_tokens=60)]
    srv = served(prompt_lookup=True, num_draft_tokens=K, kv_block_size=4, kv_cache_budget=80_000)
    spec = openai_client(srv.url)
    got = together(spec, PROMPTS, max_tokens=60)
    assert [texts(r) for r in got] == expected
    assert srv.parts.engine.stats()["preemptions"] > 0
    stream = spec.completions.create(model="m", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # cancelled mid-generation; the engine goes on with the others
    assert [texts(r) for r in together(spec, PROMPTS, max_tokens=60)] == expected


@pytest.mark.parametrize("case", ["window", "overflow", "max-kv-size", "flag-alone", "distributed"])
def test_serve_refuses_what_speculation_cannot_run_in_one_line(case, test_model_dir, llama_dir):
    """Stores that cannot rewind exactly, and combinations serve does not run, fail before serving: one line,
    non-zero exit."""
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    args = {"window": ["-m", str(test_model_dir("gemma3_text")), "--prompt-lookup"],
            "overflow": ["-m", llama_dir, "--prompt-lookup", "--kv-overflow", "window", "--kv-overflow-budget", "64"],
            "max-kv-size": ["-m", llama_dir, "--prompt-lookup", "--kv-backend", "dense", "--max-kv-size", "64"],
            "flag-alone": ["-m", llama_dir, "--num-draft-tokens", "4"],
            "distributed": ["-m", llama_dir, "--prompt-lookup", "--distributed", "tensor"]}[case]
    result = CliRunner().invoke(app, ["serve", *args, "--port", "0"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0].lower(), result.output
    assert any(word in lines[0] for word in ("speculative", "--prompt-lookup", "--num-draft-tokens")), lines[0]


def test_cached_blocks_hold_only_committed_tokens(served):
    """Token ids through the engine: after speculation with rejections, every cached chain of the prefix cache is a
    prefix of some request's prompt + generated tokens (a rejected proposal never reached a block hash). A server of
    its own: other tests' requests cache other continuations of the same prompts."""
    spec_server = served(prompt_lookup=True, num_draft_tokens=K, ngram_size=3)
    from mlxkv.engine.request import GenerationRequest
    from mlxkv.engine.sampling import SamplingParams

    def run(engine):
        handles = [engine.submit(GenerationRequest(list(p), SamplingParams(max_tokens=40))) for p in PROMPTS]
        return [[e.token for e in h if e.kind == "token"] for h in handles]

    engine = spec_server.parts.engine
    before = engine.stats()["speculative"]
    generated = run(engine)
    assert generated == run(served().parts.engine)  # token for token
    after = engine.stats()["speculative"]
    assert after["accepted_tokens"] - before["accepted_tokens"] < after["draft_tokens"] - before["draft_tokens"]
    sequences = [list(p) + g for p, g in zip(PROMPTS, generated)]
    nodes = engine.block_map()["tree"]["nodes"]
    chains: dict = {}
    for node in nodes:  # depth-first: a node's parent came before it
        chain = chains.get(node["parent"], []) + node["tokens"]
        chains[node["block"]] = chain
        ours = [s for s in sequences if s[: len(node["tokens"])] == chain[: len(node["tokens"])]]
        assert not ours or any(s[: len(chain)] == chain for s in ours), chain  # (chains of other prompts: skipped)
    assert any(len(c) > len(PROMPTS[0]) and c[:24] == PROMPTS[0] for c in chains.values())  # outputs cached too
