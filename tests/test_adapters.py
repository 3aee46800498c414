"""``--adapter-path``: an adapter in mlx-lm's format (LoRA, DoRA, full fine-tune) changes ``generate``, ``chat`` and
``serve`` exactly as mlx-lm's own ``load(adapter_path=...)`` changes ``mlx_lm.generate`` (greedy tokens equal, and
unequal to the base model's), on an mlx folder, a quantized mlx folder, an F32 GGUF and a quantized GGUF (run
quantized or ``--dequantize``) alike; a bad or mismatched adapter is one line and a non-zero exit; and the adapter is part of the cache identity: the disk tier written without it (or with another
adapter) is never hit with it, and a chat session saved with it does not resume without it.

The adapters are written by the tests (``testkit.adapters``: mlx-lm's own LoRA layers, random non-zero ``lora_b``).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from mlxkv.cli.main import app
from testkit.adapters import write_test_adapter
from typer.testing import CliRunner

runner = CliRunner()
PROMPT = "Lists are mutable sequences"
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(llama_dir, test_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two adapters of the test llama (same shapes, other tensors), a DoRA one over its attention only, and a full
    fine-tune (every weight replaced: those of the test llama of weight seed 1)."""
    root = tmp_path_factory.mktemp("adapters")
    full = root / "full"
    full.mkdir()
    shutil.copy(test_model_dir("llama", seed=1) / "model.safetensors", full / "adapters.safetensors")
    (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2}))
    return {"a": write_test_adapter(llama_dir, root / "a", seed=1),
            "b": write_test_adapter(llama_dir, root / "b", seed=2),
            "dora": write_test_adapter(llama_dir, root / "dora", seed=3, fine_tune_type="dora",
                                       keys=["self_attn.q_proj", "self_attn.v_proj"]),
            "full": full}


@functools.lru_cache(maxsize=8)
def _mlx_lm_load(model_dir: str, adapter: str | None, upcast: bool):
    from mlx_lm import load

    model, tokenizer = load(model_dir, adapter_path=adapter)
    if upcast:  # its float16 quantization scales as float32, as mlxkv runs them on the CPU backend
        from mlxkv.precision import upcast_on_cpu

        upcast_on_cpu(model)
    return model, tokenizer


def mlx_lm_text(model_dir: str | Path, adapter: Path | None, prompt: str | list[int] = PROMPT,
                max_tokens: int = TOKENS, upcast: bool = False) -> str:
    """``mlx_lm.generate``'s greedy text for ``prompt`` with the model (and adapter) loaded by mlx-lm itself."""
    from mlx_lm import generate

    model, tokenizer = _mlx_lm_load(str(model_dir), str(adapter) if adapter else None, upcast)
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return generate(model, tokenizer, tokens, max_tokens=max_tokens)


def generate(model: str | Path, *args: str) -> str:
    result = runner.invoke(app, ["generate", "-m", str(model), "--raw", "-n", str(TOKENS), *args, PROMPT])
    assert result.exit_code == 0, result.output
    return result.stdout.removesuffix("\n")


def test_generate_with_an_adapter_is_mlx_lms_generate_with_it(llama_dir, test_model_dir, adapters):
    base = mlx_lm_text(llama_dir, None)
    for name in ("a", "b", "dora", "full"):
        expected = mlx_lm_text(llama_dir, adapters[name])
        assert expected != base  # the adapter changes the greedy text
        assert generate(llama_dir, "--adapter-path", str(adapters[name])) == expected, name
    assert expected == generate(test_model_dir("llama", seed=1))  # the full fine-tune runs its own weights
    # the paged store and prompt-lookup drafting run the same adapted model
    expected = mlx_lm_text(llama_dir, adapters["a"])
    assert generate(llama_dir, "--adapter-path", str(adapters["a"]), "--kv-backend", "paged") == expected
    assert generate(llama_dir, "--adapter-path", str(adapters["a"]), "--prompt-lookup") == expected


def test_an_adapter_over_a_gguf_file_quantized_or_not(llama_dir, adapters, tmp_path):
    pytest.importorskip("gguf")
    from testkit.gguf_files import write_gguf

    for qtype in ("F32", "Q8_0"):
        gguf = write_gguf(Path(llama_dir), tmp_path / f"{qtype}.gguf", qtype)
        converted = tmp_path / qtype  # the same weights (Q8_0: quantized layers) as a folder mlx-lm loads
        assert runner.invoke(app, ["convert", str(gguf), str(converted)]).exit_code == 0
        expected = mlx_lm_text(converted, adapters["a"], upcast=True)  # LoRA over mlx-lm's (Quantized)Linear
        assert expected != mlx_lm_text(converted, None, upcast=True)
        # The tokenizer mlxkv builds from GGUF metadata keeps a first token's leading space, which mlx-lm's
        # detokenizer of the converted folder trims (adapter or not): the tokens are the same.
        assert generate(gguf, "--adapter-path", str(adapters["a"])).removeprefix(" ") == expected, qtype
    # the quantized folder itself, and --dequantize: the adapter over the dequantized layers, as mlx-lm's
    # dequantize_model leaves an adapted model
    assert generate(converted, "--adapter-path", str(adapters["a"])) == expected
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm.utils import dequantize_model

    model, tokenizer = _mlx_lm_load(str(converted), str(adapters["a"]), True)
    plain = mlx_lm_generate(dequantize_model(model), tokenizer, tokenizer.encode(PROMPT), max_tokens=TOKENS)
    _mlx_lm_load.cache_clear()  # the cached model is dequantized now
    assert generate(gguf, "--adapter-path", str(adapters["a"]), "--dequantize").removeprefix(" ") == plain


def test_chat_with_an_adapter_answers_as_mlx_lm(llama_dir, adapters, tmp_path):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(llama_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    expected = mlx_lm_text(llama_dir, adapters["a"], prompt)
    assert expected != mlx_lm_text(llama_dir, None, prompt)
    env = {"MLXKV_SESSIONS_DIR": str(tmp_path / "sessions")}
    done = runner.invoke(app, ["chat", "-m", llama_dir, "--adapter-path", str(adapters["a"]), "-n", str(TOKENS)],
                         input=f"{PROMPT}\n/save adapted\n", env=env)
    assert done.exit_code == 0, done.output
    assert done.stdout == expected + "\n"
    assert f"with adapter {adapters['a']}" in done.stderr
    # the saved KV cache was computed with the adapter: it resumes with it, and without it (or with another) not
    again = runner.invoke(app, ["chat", "-m", llama_dir, "--adapter-path", str(adapters["a"]), "--resume",
                                "adapted"], input="", env=env)
    assert again.exit_code == 0 and "resumed session adapted" in again.stderr, again.output
    for other in ([], ["--adapter-path", str(adapters["b"])]):
        refused = runner.invoke(app, ["chat", "-m", llama_dir, *other, "--resume", "adapted"], input="", env=env)
        assert refused.exit_code == 1 and refused.stderr.count("\n") == 1, refused.output
        assert "was saved with" in refused.stderr and "--adapter-path" in refused.stderr


def _refused(args: list[str], code: int, *fragments: str) -> None:
    """The command fails with exit ``code`` (2: the option's value refused before any work; 1: once the model
    loads) and one ``error:`` line holding ``fragments``."""
    result = runner.invoke(app, args, input="")
    assert result.exit_code == code, result.output
    line = result.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in line, line


def test_a_bad_or_mismatched_adapter_is_one_line_on_every_command(llama_dir, adapters, tmp_path):
    good = adapters["a"]
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(good / "adapter_config.json", no_weights)
    bad_json = shutil.copytree(good, tmp_path / "bad-json")
    (bad_json / "adapter_config.json").write_text("{rank: 4")
    other_rank = shutil.copytree(good, tmp_path / "rank-8")  # tensors of rank 4 for layers built with rank 8
    config = json.loads((good / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (other_rank / "adapter_config.json").write_text(json.dumps(config))
    other_keys = shutil.copytree(good, tmp_path / "other-keys")  # tensors for layers the config does not adapt
    config["lora_parameters"].update(rank=4, keys=["mlp.down_proj"])
    (other_keys / "adapter_config.json").write_text(json.dumps(config))
    alpha = shutil.copytree(good, tmp_path / "alpha")
    config["lora_parameters"] = {"rank": 4, "alpha": 16, "dropout": 0.0}
    (alpha / "adapter_config.json").write_text(json.dumps(config))
    truncated = shutil.copytree(good, tmp_path / "truncated")
    (truncated / "adapters.safetensors").write_bytes((good / "adapters.safetensors").read_bytes()[:100])
    partial = shutil.copytree(good, tmp_path / "partial")  # lora_b without its lora_a: a random lora_a would run
    import mlx.core as mx

    tensors = mx.load(str(good / "adapters.safetensors"))
    mx.save_safetensors(str(partial / "adapters.safetensors"),
                        {k: v for k, v in tensors.items() if not k.endswith("q_proj.lora_a")})
    unreadable = [(tmp_path / "missing", ("no such folder",)),  # refused as the option's value
                  (good / "adapters.safetensors", ("not a folder",)),
                  (no_weights, ("no adapters.safetensors",)),
                  (bad_json, ("adapter_config.json is not valid JSON",)),
                  (alpha, ("'scale', not 'alpha'",))]
    unfit = [(other_rank, ("does not fit this model", "adapter shape", "more tensors")),  # once the model loads
             (other_keys, ("does not fit this model", "not an adapter parameter")),
             (truncated, ("cannot load the adapter", "file is only 100 bytes")),
             (partial, ("lacks model.layers.0.self_attn.q_proj.lora_a (and 1 more)",))]
    for path, fragments in unreadable:
        _refused(["generate", "-m", llama_dir, "--adapter-path", str(path), "hi"], 2,
                 f"Invalid value for '--adapter-path': {path}", *fragments)
    for path, fragments in unfit:
        _refused(["generate", "-m", llama_dir, "--adapter-path", str(path), "hi"], 1, f"--adapter-path {path}",
                 *fragments)
    for command in (["chat"], ["serve", "--port", "0"]):
        _refused([*command, "-m", llama_dir, "--adapter-path", str(unreadable[0][0])], 2, "no such folder")
        _refused([*command, "-m", llama_dir, "--adapter-path", str(other_rank)], 1, "does not fit this model")
    _refused(["serve", "--port", "0", "--adapter-path", str(good), "--distributed", "tensor"], 1, "drop --distributed")
    _refused(["generate", "--adapter-path", str(good), "--distributed", "tensor", "hi"], 1, "drop --distributed")


def _serve(llama_dir: str, adapter: Path | None, tier: Path | None = None):
    """The test llama served in this process (paged KV; a disk tier in ``tier``), with ``adapter`` over it."""
    from testkit.run_config import run_config
    from testkit.serve_thread import serve_in_thread

    disk = {"disk_cache_dir": str(tier), "disk_cache_bytes": 1 << 26} if tier is not None else {}
    return serve_in_thread(run_config(llama_dir, kv_backend="paged", adapter_path=str(adapter) if adapter else None,
                                      **disk), model_name="tiny-llama")


def _complete(srv, prompt: str = PROMPT) -> tuple[str, int]:
    """The greedy completion of ``prompt`` and how many of its tokens came from the prefix cache."""
    from testkit.serve_thread import openai_client

    reply = openai_client(srv.url).completions.create(model="tiny-llama", prompt=prompt, max_tokens=TOKENS,
                                                      temperature=0)
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, details.cached_tokens if details else 0


def test_serve_with_an_adapter_answers_as_mlx_lm(llama_dir, adapters):
    from mlx_lm.utils import load_tokenizer

    from testkit.serve_thread import openai_client

    messages = [{"role": "user", "content": PROMPT}]
    chat_prompt = load_tokenizer(Path(llama_dir)).apply_chat_template(messages, add_generation_prompt=True)
    with _serve(llama_dir, adapters["a"]) as srv:
        first, again = _complete(srv), _complete(srv)
        chat = openai_client(srv.url).chat.completions.create(model="tiny-llama", messages=messages,
                                                              max_tokens=TOKENS, temperature=0)
    assert first == (mlx_lm_text(llama_dir, adapters["a"]), 0)
    assert again[0] == first[0] and again[1] > 0  # the prefix cache hit computes the same adapted tokens
    assert chat.choices[0].message.content == mlx_lm_text(llama_dir, adapters["a"], chat_prompt)


def test_the_disk_tier_never_serves_one_adapters_kv_to_another(llama_dir, adapters, tmp_path):
    """Blocks written to the disk tier without an adapter, or with adapter a, are not hit by a server with adapter
    a, or with a copy of a at another scale (the same tensors: only the adapter's digest tells the two apart), and
    are hit by the server that wrote them after a restart; every answer is mlx-lm's for its adapter."""
    from testkit.serve_thread import openai_client

    rescaled = shutil.copytree(adapters["a"], tmp_path / "a-rescaled")
    config = json.loads((rescaled / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] /= 2
    (rescaled / "adapter_config.json").write_text(json.dumps(config))
    tier = tmp_path / "tier"
    prompt = PROMPT * 6  # a few full blocks
    runs = [None, adapters["a"], rescaled]
    expected = [mlx_lm_text(llama_dir, adapter, prompt) for adapter in runs]
    assert len(set(expected)) == 3
    fingerprints = set()
    for adapter, text in zip(runs, expected):  # each start finds only the others' blocks: nothing to hit
        with _serve(llama_dir, adapter, tier) as srv:
            assert _complete(srv, prompt) == (text, 0), adapter
            fingerprints.add(openai_client(srv.url).completions.create(
                model="tiny-llama", prompt="x", max_tokens=1).system_fingerprint)
    assert len(fingerprints) == 3  # OpenAI's system_fingerprint tells the three apart too
    assert len(list(tier.glob("*.mlxkvblk"))) >= 3 * 3  # each server's stop wrote its blocks
    with _serve(llama_dir, adapters["a"], tier) as srv:  # a restart hits its own blocks, with its own answer
        text, cached = _complete(srv, prompt)
    assert text == expected[1] and cached > 0


@pytest.mark.real_model
def test_smollm2_with_an_adapter_answers_as_mlx_lm(smollm2_f32_folder, tmp_path):
    """SmolLM2-135M's GGUF run --dequantize with a rank-8 adapter over its last 16 layers: mlx-lm's answer for the same
    float32 weights (the folder ``mlxkv convert --dequantize`` writes) with the same adapter."""
    from mlx_lm.utils import load_tokenizer

    from testkit.real_model import GGUF

    adapter = write_test_adapter(smollm2_f32_folder, tmp_path / "adapter", seed=5, rank=8, scale=2.0, num_layers=16)
    question = "What is the capital of France?"
    tokenizer = load_tokenizer(smollm2_f32_folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    expected = mlx_lm_text(smollm2_f32_folder, adapter, prompt, max_tokens=30)
    assert expected != mlx_lm_text(smollm2_f32_folder, None, prompt, max_tokens=30)
    result = runner.invoke(app, ["generate", "-m", str(GGUF), "--dequantize", "--adapter-path", str(adapter),
                                 "-n", "30", question])
    assert result.exit_code == 0, result.output
    assert result.stdout.removesuffix("\n") == expected
