"""GGUF K-quants: each block type decoded as llama.cpp's ``gguf`` package decodes it, rewritten as MLX affine
quantization (exactly where MLX has the group, within a measured bound where it does not), and a Q4_K_M-style
mix and a Q6_K file of a random-weight llama (hidden 256: one K-quant super-block per row segment) running
through ``mlxkv generate``, ``serve`` and ``chat`` with the greedy tokens mlx-lm gives on the same weights.

The gguf package has dequantizers but no quantizers for K-quants, so the blocks are random bytes with sane
scales (``tests/testkit/kquant_files.py``); the reference model is the package's dequantization of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxkv.cli.main import app
from typer.testing import CliRunner

gguf = pytest.importorskip("gguf")
runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Lists are mutable sequences, typically used to store collections"
TOKENS = 16
#: The tiny llama at the K-quants' smallest row: 256 (one super-block).
LLAMA_256 = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
#: Byte offsets of float16 scales in each block type (set to sane values in random blocks), Q8_K's float32 one.
F16_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    from mlxkv.gguf.kquants import BLOCKS

    rng = np.random.default_rng(seed)
    per_block, size = BLOCKS[kind]
    n = rows * cols // per_block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in F16_SCALES.get(kind, []):
        raw[:, at:at + 2] = rng.uniform(1e-3, 1e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if kind == "Q8_K":
        raw[:, 0:4] = rng.uniform(1e-3, 1e-2, n).astype(np.float32).view(np.uint8).reshape(n, 4)
    return raw


def _oracle(kind: str, raw: np.ndarray, rows: int) -> np.ndarray:
    """The gguf package's dequantization (Q8_K, which it does not dequantize: ``d * q`` from the bytes)."""
    if kind == "Q8_K":
        d = np.ascontiguousarray(raw[:, 0:4]).view(np.float32)
        return (d * raw[:, 4:260].view(np.int8).astype(np.float32)).reshape(rows, -1)
    return gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[kind]).astype(np.float32)


ALL_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_each_block_type_decodes_exactly_as_the_gguf_package_does(kind):
    from mlxkv.gguf.kquants import decode

    rows, cols = 48, 1024
    raw = _random_blocks(kind, rows, cols)
    ours, exact = decode(kind, raw, rows, cols).dequantize(), _oracle(kind, raw, rows)
    if kind == "Q8_K":  # float32 d: d * (code - 128) computed as d * code - 128 d rounds once more
        d = np.ascontiguousarray(raw[:, 0:4]).view(np.float32).reshape(rows, -1)
        assert (np.abs(ours - exact).reshape(rows, -1, 256).max(-1) <= d * 2 ** -15).all()
    else:
        assert np.array_equal(ours, exact)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_the_affine_form_is_exact_for_32_wide_sub_blocks_and_within_an_8_bit_step_otherwise(kind):
    from mlxkv.gguf.kquants import REQUANTIZED, affine, decode

    rows, cols = 48, 1024
    raw = _random_blocks(kind, rows, cols, seed=1)
    codes = decode(kind, raw, rows, cols)
    packed, scales, biases, bits = affine(codes)
    ours = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=32, bits=bits))
    exact = _oracle(kind, raw, rows)
    if kind not in REQUANTIZED:
        assert bits == codes.bits and np.array_equal(ours, codes.dequantize())
        assert kind == "Q8_K" or np.array_equal(ours, exact)
        return
    # Two 16-weight sub-blocks share an MLX group: 8 bits over the group's range, so at most half a step of it.
    assert bits == 8
    groups = exact.reshape(rows, -1, 32)
    half_step = (groups.max(-1) - groups.min(-1)) / 255 / 2
    err = np.abs(ours - exact).reshape(rows, -1, 32).max(-1)
    assert (err <= half_step * 1.001 + 1e-8).all()
    # and against the type's own step (the larger of the group's two sub-block scales): a group spans at most 64
    # Q6_K steps or 8 Q3_K steps; Q2_K's two minimums add to the range (measured: at most 0.052 of a step)
    step = np.abs(codes.scale).reshape(rows, -1, 2).max(-1)
    ratio = (err / np.maximum(step, 1e-30))[step > 0].max()
    assert ratio <= {"Q6_K": 32 / 255, "Q3_K": 4 / 255, "Q2_K": 0.06}[kind] * 1.001, ratio


def _mix(name: str) -> str:
    """llama.cpp's Q4_K_M recipe on two layers: Q6_K for the output matrix and for the first layer's attn_v and
    ffn_down (its "more bits" layers), Q4_K everywhere else, the token embedding included."""
    if name == "lm_head.weight" or ("layers.0." in name and ("v_proj" in name or "down_proj" in name)):
        return "Q6_K"
    return "Q4_K"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{label: (reference folder, gguf file)}`` for the Q4_K_M mix, an all-Q6_K and an all-Q4_K file, written once."""
    from testkit.archs import ARCHITECTURES, build_from_config
    from testkit.gguf_files import write_gguf
    from testkit.kquant_files import kquant_model
    from testkit.models import write_model

    root = tmp_path_factory.mktemp("kquants")
    base = write_model(*build_from_config({**ARCHITECTURES["llama"], **LLAMA_256}), root / "base")
    matrices = [k for k, v in mx.load(str(base / "model.safetensors")).items() if v.ndim == 2]
    out = {}
    for label, pick in (("Q4_K_M", _mix), ("Q6_K", lambda _: "Q6_K"), ("Q4_K", lambda _: "Q4_K")):
        ref, blocks = kquant_model(base, root / f"ref-{label}", {m: pick(m) for m in matrices})
        out[label] = (ref, write_gguf(ref, root / f"{label}.gguf", "F32", blocks=blocks))
    return out


def _logits(model, tokens: list[int]) -> mx.array:
    return model(mx.array([tokens]))[0]


def _mlx_lm_greedy(folder: Path, n: int = TOKENS) -> tuple[list[int], object]:
    """mlx-lm's greedy tokens for PROMPT (raw, no chat template) on ``folder``, cut at the first EOS."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, tokenizer = load(str(folder))
    out = [int(t) for t, _ in generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=n)]
    eos = set(tokenizer.eos_token_ids)
    return out[:next((i for i, t in enumerate(out) if t in eos), len(out))], tokenizer


def _streamed(tokenizer, tokens: list[int]) -> str:
    """``tokens`` as mlx-lm's streaming detokenizer for this tokenizer writes them (what mlx-lm's server answers)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize("label", ["Q4_K_M", "Q6_K", "Q4_K"])
def test_k_quant_files_stay_quantized_with_each_tensor_s_bits(label, files):
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load

    ref, path = files[label]
    ours = load(str(path))
    bits = {name: m.bits for name, m in ours.model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    expected = {"Q4_K_M": {n: 8 if _mix(f"{n}.weight") == "Q6_K" else 4 for n in bits}, "Q6_K": dict.fromkeys(bits, 8),
                "Q4_K": dict.fromkeys(bits, 4)}[label]
    assert len(bits) == 16 and bits == expected
    model, tokenizer = mlx_lm_load(str(ref))
    tokens = tokenizer.encode(PROMPT)
    assert ours.tokenizer.encode(PROMPT) == tokens
    a, b = _logits(ours.model, tokens), _logits(model, tokens)
    err = (mx.abs(a - b).max() / mx.abs(b).max()).item()
    # Q4_K keeps its codes, scales and mins (float32 on the CPU backend): only the order of float sums differs.
    # Q6_K is re-quantized at 8 bits: 0.41% RMS weight error on these random blocks (whose adjacent sub-block
    # scales are unrelated, a worst case), which the random two-layer model amplifies to a measured 8.2% of the
    # largest logit for all-Q6_K (RMS 3.9%); greedy tokens still agree (the tests below).
    assert err <= {"Q4_K": 1e-5, "Q4_K_M": 0.05, "Q6_K": 0.1}[label], err


@pytest.mark.parametrize("label", ["Q4_K_M", "Q6_K"])
def test_dequantize_gives_exactly_the_gguf_package_s_weights(label, files):
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load

    ref, path = files[label]
    ours = load(str(path), dequantize=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in ours.model.named_modules())
    model, tokenizer = mlx_lm_load(str(ref))
    tokens = tokenizer.encode(PROMPT)
    assert mx.array_equal(_logits(ours.model, tokens), _logits(model, tokens))


# The Q4_K_M mix keeps most layers exact (Q4_K) and re-quantizes three (Q6_K); an all-Q6_K file re-quantizes every
# layer, and this random model, which turns a 0.4% weight error into ~4% of its logits, leaves mlx-lm's greedy path
# after 5 tokens: Q6_K is checked here with --dequantize (exact), its affine form by the logit bound above.
DOORS = [("Q4_K_M", False), ("Q6_K", True), ("Q4_K_M", True)]


@pytest.mark.parametrize("label, dequantize", DOORS)
def test_generate_gives_mlx_lm_s_greedy_tokens(label, dequantize, files):
    ref, path = files[label]
    expected, tokenizer = _mlx_lm_greedy(ref)
    result = runner.invoke(app, ["generate", "-m", str(path), "--raw", "-n", str(TOKENS), PROMPT,
                                 *(["--dequantize"] if dequantize else [])])
    assert result.exit_code == 0, result.output
    assert len(expected) > 4 and result.stdout.strip() == _streamed(tokenizer, expected).strip()


@pytest.mark.parametrize("label, dequantize", DOORS[:2])
def test_serve_answers_with_mlx_lm_s_greedy_tokens(label, dequantize, files):
    from testkit.run_config import run_config
    from testkit.serve_thread import openai_client, serve_in_thread

    ref, path = files[label]
    expected, tokenizer = _mlx_lm_greedy(ref)
    with serve_in_thread(run_config(str(path), dequantize=dequantize), model_name="kq") as srv:
        r = openai_client(srv.url).completions.create(model="kq", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    # mlx-lm streams the folder's text without its first leading space, a GGUF's tokenizer streams it as decoded
    assert r.choices[0].text.lstrip(" ") == _streamed(tokenizer, expected)


def test_chat_from_a_pipe_answers_as_on_the_reference_folder(files, tmp_path):
    ref, path = files["Q4_K_M"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"}

    def chat(model: Path) -> str:
        done = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "-m", str(model), "-n", "12"],
                              input="Hello there\nWhat is a list?\n/exit\n", capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith(f"mlxkv chat with {model}:")  # the greeting names the model, on stderr
        return done.stdout  # the answers alone

    ours, theirs = chat(path), chat(ref)
    assert ours == theirs and len(ours.strip()) > 20  # the two answers, identical


def test_convert_writes_per_layer_bits_that_mlx_lm_loads(files, tmp_path):
    import json

    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load
    from mlxkv.precision import upcast_on_cpu

    _, path = files["Q4_K_M"]
    result = runner.invoke(app, ["convert", str(path), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["lm_head"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.0.self_attn.v_proj"]["bits"] == 8 and "model.layers.1.self_attn.v_proj" not in quant
    model, tokenizer = mlx_lm_load(str(tmp_path / "out"))
    upcast_on_cpu(model)
    tokens = tokenizer.encode(PROMPT)
    assert mx.array_equal(_logits(load(str(path)).model, tokens), _logits(model, tokens))


def test_an_i_quant_is_refused_naming_its_type(tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 256 // block * size), np.uint8),
                      raw_shape=(64, 256 // block * size), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = runner.invoke(app, ["generate", "-m", str(tmp_path / "iq.gguf"), "--raw", "-n", "2", "hi"])
    line = result.stderr.strip()
    assert result.exit_code == 1 and "\n" not in line and line.startswith("error: "), result.output
    assert "blk.0.attn_q.weight" in line and "IQ2_XXS" in line and "Q4_K" in line and "Q6_K" in line


def test_the_block_reader_reads_float_tensors_as_they_are_and_3d_blocks_by_row(tmp_path):
    """A file the block reader handles (it holds a K-quant) with F32, F16 and BF16 tensors beside it."""
    from gguf import GGMLQuantizationType

    from mlxkv.gguf.reader import read

    rng = np.random.default_rng(3)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((4, 6)).astype(np.float16)
    bf16 = (rng.standard_normal((2, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    q4k = _random_blocks("Q4_K", 6, 256, seed=4)  # six rows, kept as a (2, 3, 256) tensor
    writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    writer.add_tensor("a.weight", f32)
    writer.add_tensor("b.weight", f16)
    writer.add_tensor("c.weight", bf16, raw_dtype=GGMLQuantizationType.BF16)
    writer.add_tensor("d.weight", q4k.reshape(2, 3, -1), raw_shape=(2, 3, q4k.shape[1]),
                      raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = read(tmp_path / "mixed.gguf")
    t = file.tensors
    assert np.array_equal(np.array(t["a.weight"]), f32) and np.array_equal(np.array(t["b.weight"]), f16)
    assert t["c.weight"].dtype == mx.bfloat16
    assert np.array_equal(np.array(t["c.weight"].astype(mx.float32)), (bf16.astype(np.uint32) << 16).view(np.float32))
    assert t["d.weight"].shape == (2, 3, 32) and t["d.scales"].shape == (2, 3, 8)
    w = mx.dequantize(t["d.weight"], t["d.scales"], t["d.biases"], group_size=32, bits=4)
    assert np.array_equal(np.array(w).reshape(6, 256), _oracle("Q4_K", q4k, 6))
    dense = read(tmp_path / "mixed.gguf", dequantize=True).tensors["d.weight"]
    assert dense.shape == (2, 3, 256) and np.array_equal(np.array(dense).reshape(6, 256), _oracle("Q4_K", q4k, 6))


def test_a_q4_k_gemma3_keeps_its_tied_quantized_embedding_and_shifted_norms(tmp_path):
    """Gemma 3 as Q4_K: the tied token embedding is the (quantized) output layer too, the norms come back from the
    stored 1 + w; exact codes, so the logits are mlx-lm's on the dequantized folder up to the order of float sums."""
    from mlx_lm.utils import load as mlx_lm_load
    from testkit.archs import ARCHITECTURES, build_from_config
    from testkit.gguf_files import write_gguf
    from testkit.kquant_files import kquant_model
    from testkit.models import write_model

    from mlxkv.models import load

    config = {**ARCHITECTURES["gemma3_text"], **LLAMA_256, "num_key_value_heads": 1, "head_dim": 64,
              "query_pre_attn_scalar": 64, "sliding_window_pattern": 2}
    base = write_model(*build_from_config(config), tmp_path / "base")
    weights = mx.load(str(base / "model.safetensors"))
    del weights["lm_head.weight"]  # tied, as Gemma's releases are
    mx.save_safetensors(str(base / "model.safetensors"), weights, metadata={"format": "mlx"})
    matrices = [k for k, v in weights.items() if v.ndim == 2]
    ref, blocks = kquant_model(base, tmp_path / "ref", dict.fromkeys(matrices, "Q4_K"))
    pattern = {"gemma3.attention.sliding_window_pattern": 2}  # the key llama.cpp reads when a converter writes it
    ours = load(str(write_gguf(ref, tmp_path / "g.gguf", "F32", blocks=blocks, extra_metadata=pattern)))
    assert ours.model.model.embed_tokens.bits == 4 and "lm_head" not in dict(ours.model.named_modules())
    model, tokenizer = mlx_lm_load(str(ref))
    tokens = tokenizer.encode(PROMPT)
    a, b = _logits(ours.model, tokens), _logits(model, tokens)
    assert (mx.abs(a - b).max() / mx.abs(b).max()).item() <= 1e-5
