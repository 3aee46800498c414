"""``mlxkv serve --draft-model M``: a draft model proposing tokens for every speculating decode row, through the
official clients, on the random-weight test llama. Drafts: the target itself (every proposal accepted) and its first
layer with its own embedding, norm and head (few accepted). Greedy output equals a server without speculation token
for token — concurrent rows drafted in shared draft forwards and verified in one target forward, ``n > 1``, stop
strings, penalties, ``logprobs``, structured output, preemption and resume, a cancelled neighbour — and the draft's
KV is all given back afterwards; the draft's own prefix cache hits on a repeated prompt; at temperature 1 rejection
sampling with the draft's probabilities keeps the target's distribution; the one-line refusals."""

import json
from collections import Counter

import pytest
from test_speculative_sampling import chi_square_ok
from testkit.draft_models import first_layers
from testkit.serve_thread import openai_client
from testkit.speculative_requests import complete, speculative_usage, texts, together
from testkit.waiting import wait_for

pytestmark = [pytest.mark.float_order, pytest.mark.server]

K = 4


def cycle(a):
    return [a, a + 1, a + 2] * 8


PROMPTS = [cycle(73), cycle(192), cycle(122), list(range(10, 40))]


@pytest.fixture(scope="module")
def shallow_draft(llama_dir, tmp_path_factory):
    """The test llama's first layer, with its embedding, final norm and head: same vocabulary, few agreements."""
    return str(first_layers(llama_dir, 1, tmp_path_factory.mktemp("llama-1-layer")))


@pytest.fixture(scope="module")
def plain(served):
    return openai_client(served().url)


@pytest.fixture(scope="module")
def expected(plain):
    return [texts(r) for r in together(plain, PROMPTS)]


def draft_stats(server):
    return server.parts.engine.stats()["speculative"]


def assert_draft_kv_given_back(server):
    """Every draft sequence released and no draft block held (cached blocks stay for later prefix hits), as the
    engine's stats say once it has published the step that ended the last request."""
    def given_back():
        stats = server.parts.engine.stats()
        draft = stats["speculative"]["draft_model"]
        return (draft["sequences"] == 0 and draft["kv_blocks"]["used"] == 0 and draft["kv_bytes"] == 0
                and stats["pool_sequences"] == 0)

    wait_for(given_back, timeout=10)


def test_the_target_as_its_own_draft_accepts_everything_in_batched_forwards(served, llama_dir, expected):
    srv = served(draft_model=llama_dir, num_draft_tokens=K)
    got = together(openai_client(srv.url), PROMPTS)
    assert [texts(r) for r in got] == expected
    for r in got:
        used = speculative_usage(r)
        assert used["accepted_tokens"] == used["proposed_tokens"] > 0, used
    stats = draft_stats(srv)
    assert stats["drafter"] == "draft_model" and stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_forward"] > 2.0
    assert stats["draft_model"]["rows_per_forward"] > 1.0  # rows drafted together, not one forward per row
    assert srv.parts.engine.stats()["batched_verify_steps_total"] > 0
    assert_draft_kv_given_back(srv)


@pytest.fixture(scope="module")
def spec_server(served, shallow_draft):
    return served(draft_model=shallow_draft, num_draft_tokens=K)


@pytest.fixture(scope="module")
def spec(spec_server):
    return openai_client(spec_server.url)


def test_a_shallow_draft_is_exact_with_proposals_accepted_and_rejected(spec_server, spec, expected):
    before = draft_stats(spec_server)
    got = together(spec, PROMPTS)
    assert [texts(r) for r in got] == expected
    used = [speculative_usage(r) for r in got]
    proposed, accepted = sum(u["proposed_tokens"] for u in used), sum(u["accepted_tokens"] for u in used)
    assert 0 < accepted < proposed, used
    wait_for(lambda: draft_stats(spec_server)["draft_tokens"] - before["draft_tokens"] == proposed, timeout=10)
    after = draft_stats(spec_server)
    assert after["accepted_tokens"] - before["accepted_tokens"] == accepted
    assert after["draft_model"]["failures"] == 0
    assert_draft_kv_given_back(spec_server)


def test_the_drafts_prefix_cache_hits_on_a_repeated_prompt(spec_server, spec):
    prompt = list(range(200, 260))  # 60 tokens: three full blocks of 16 before the last
    complete(spec, prompt, max_tokens=4)
    before = draft_stats(spec_server)["draft_model"]["cached_tokens"]
    complete(spec, prompt, max_tokens=4)
    wait_for(lambda: draft_stats(spec_server)["draft_model"]["cached_tokens"] - before >= 48, timeout=10)


def test_n_stop_penalties_logprobs_structured_output_and_the_request_field(plain, spec, spec_server):
    prompt = PROMPTS[0]
    two = complete(spec, prompt, n=2, max_tokens=30)
    assert texts(two) == texts(complete(plain, prompt, n=2, max_tokens=30))
    assert speculative_usage(two)["proposed_tokens"] > 0
    full = texts(complete(plain, prompt))[0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert texts(complete(spec, prompt, stop=[stop]))[0] == texts(complete(plain, prompt, stop=[stop]))[0]
    for extra in ({"frequency_penalty": 0.7}, {"logit_bias": {"17": 5}}):
        got = complete(spec, prompt, **extra)
        assert texts(got) == texts(complete(plain, prompt, **extra))
        assert speculative_usage(got)["proposed_tokens"] > 0  # penalised and biased rows speculate too
    got = complete(spec, prompt, logprobs=2)
    expected = complete(plain, prompt, logprobs=2)
    assert texts(got) == texts(expected) and speculative_usage(got) is None
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    messages = [{"role": "user", "content": "give a"}]
    content = [c.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                         response_format=fmt).choices[0].message.content for c in (plain, spec)]
    assert content[0] == content[1]
    json.loads(content[1])
    off = complete(spec, prompt, extra_body={"speculative": False})
    assert speculative_usage(off) is None and texts(off) == texts(complete(plain, prompt))
    one = complete(spec, prompt, max_tokens=20, extra_body={"speculative": {"num_draft_tokens": 1}})
    assert texts(one) == texts(complete(plain, prompt, max_tokens=20))
    assert speculative_usage(one)["proposed_tokens"] <= 19  # one token per step at most
    assert_draft_kv_given_back(spec_server)


def test_preemption_and_a_cancelled_neighbour_keep_greedy_output_and_free_the_draft(served, shallow_draft, plain):
    """A KV budget that holds about two of the four sequences: rows are preempted mid-speculation (their draft
    sequences released) and resume (their drafts reopened over what they committed)."""
    expected = [texts(r) for r in together(plain, PROMPTS, max_tokens=60)]
    srv = served(draft_model=shallow_draft, num_draft_tokens=K, kv_block_size=4, kv_cache_budget=80_000)
    spec = openai_client(srv.url)
    assert [texts(r) for r in together(spec, PROMPTS, max_tokens=60)] == expected
    assert srv.parts.engine.stats()["preemptions"] > 0
    stream = spec.completions.create(model="m", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # cancelled mid-generation
    assert [texts(r) for r in together(spec, PROMPTS, max_tokens=60)] == expected
    assert_draft_kv_given_back(srv)


def test_the_dense_store_equals_plain_decoding(served, shallow_draft, expected):
    srv = served(kv_backend="dense", draft_model=shallow_draft, num_draft_tokens=K)
    got = together(openai_client(srv.url), PROMPTS)
    assert [texts(r) for r in got] == expected
    assert sum(speculative_usage(r)["accepted_tokens"] for r in got) > 0
    assert_draft_kv_given_back(srv)


def next_token_probs(model, tokens, top_k):
    """``model``'s sampling distribution ``(V,)`` after ``tokens`` at temperature 1, top-k ``top_k``."""
    import mlx.core as mx

    from mlxkv.engine.sampling import SamplingParams
    from mlxkv.engine.verify import sampling_logprobs

    logits = model(mx.array(tokens)[None])[:, -1, :]  # (1, V)
    return mx.exp(sampling_logprobs(logits, SamplingParams(temp=1.0, top_k=top_k)))[0]  # (V,)


def exact_distribution(model, prompt, steps, top_k):
    """The target's exact distribution of its first ``steps`` sampled tokens."""
    dist = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for seq, p in dist.items():
            for token, q in enumerate(next_token_probs(model, prompt + list(seq), top_k).tolist()):
                if q > 0:
                    grown[seq + (token,)] = p * q
        dist = grown
    return dist


@pytest.mark.slow
def test_sampled_rows_keep_the_targets_distribution(served, shallow_draft, llama_dir):
    """Temperature 1, top-k 3, a prompt the prefix cache holds (each choice's first token is a decode step's, with a
    one-token draft): the two tokens of 800 samples follow the target's exact distribution (chi-square, alpha ~
    1e-4), and the draft's tokens are accepted as often as rejection sampling with the draft's real probabilities q
    accepts them (``sum min(p, q)``), far more often than if they were taken for point masses (``sum p q``)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxkv.engine.request import GenerationRequest
    from mlxkv.engine.sampling import SamplingParams

    srv = served(draft_model=shallow_draft, num_draft_tokens=2)
    engine, prompt, samples = srv.parts.engine, PROMPTS[0], []
    params = SamplingParams(max_tokens=2, temp=1.0, top_k=3)
    list(engine.submit(GenerationRequest(list(prompt), params)))  # the prompt is cached from here on
    before = draft_stats(srv)
    for _ in range(200 // 8):
        handles = [engine.submit(GenerationRequest(list(prompt), params, n=4)) for _ in range(8)]
        for h in handles:
            tokens: dict = {}
            for e in h:
                if e.kind == "token" and e.token is not None:
                    tokens.setdefault(e.index, []).append(e.token)
            samples += [tuple(t) for t in tokens.values()]
    after = draft_stats(srv)
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert drafted >= 400, drafted  # most first tokens were drafted
    target, draft = load(llama_dir)[0], load(shallow_draft)[0]
    p, q = (next_token_probs(m, prompt, 3) for m in (target, draft))
    real, point = mx.minimum(p, q).sum().item(), (p * q).sum().item()
    assert real - point > 0.15  # the test can tell them apart (about 0.45 and 0.26)
    assert abs(accepted / drafted - real) < 4 * (real * (1 - real) / drafted) ** 0.5 + 0.01, (accepted, drafted, real)
    exact = exact_distribution(target, prompt, 2, 3)
    stat, critical = chi_square_ok(Counter(samples), exact, len(samples))
    assert stat < critical, (stat, critical)
    assert_draft_kv_given_back(srv)


@pytest.mark.parametrize("case", ["distributed", "vocabulary", "window", "ngram", "missing"])
def test_serve_refuses_what_a_draft_model_cannot_run_in_one_line(case, test_model_dir, llama_dir, tmp_path):
    from typer.testing import CliRunner

    from mlxkv.cli.main import app
    from testkit.archs import build_from_config, get_config
    from testkit.models import write_model

    if case == "vocabulary":
        other = write_model(*build_from_config({**get_config("llama"), "vocab_size": 300}), tmp_path / "other")
        draft = ["--draft-model", str(other)]
    elif case == "window":
        draft = ["--draft-model", str(test_model_dir("gemma3_text"))]
    elif case == "missing":
        draft = ["--draft-model", str(tmp_path / "no-such-draft")]
    else:
        draft = ["--draft-model", llama_dir]
    extra = {"distributed": ["--distributed", "tensor"], "ngram": ["--ngram-size", "2"]}.get(case, [])
    result = CliRunner().invoke(app, ["serve", "-m", llama_dir, *draft, *extra, "--port", "0"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0].lower(), result.output
    expected_word = {"distributed": "--distributed", "vocabulary": "vocabulary", "window": "draft model",
                     "ngram": "--prompt-lookup", "missing": "--draft-model"}[case]
    assert expected_word in lines[0], lines[0]
