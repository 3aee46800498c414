"""GGUF loading: test models written by llama.cpp's own writer load back as the models they came from.

The files are written with llama.cpp's ``gguf`` package (its tensor-name map, its quantizers, its
converter's q/k permutation: ``tests/testkit/gguf_files.py``), so these tests check mlxkv's reading against an
independent writer. The real SmolLM2-135M file is covered in ``test_real_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxkv.cli.main import app
from testkit.gguf_files import dequantized, write_gguf
from typer.testing import CliRunner

pytest.importorskip("gguf")
runner = CliRunner()
PROMPT = "Lists are mutable sequences, typically used to store collections"

QWEN2 = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def hf_folder(test_model_dir, tmp_path_factory):
    """``hf_folder(arch)``: a Hugging Face folder of the test model (qwen2 built here: it has q/k/v biases)."""
    from testkit.archs import build_from_config
    from testkit.models import write_model

    qwen2 = None

    def get(arch: str) -> Path:
        nonlocal qwen2
        if arch != "qwen2":
            return test_model_dir(arch)
        if qwen2 is None:
            qwen2 = write_model(*build_from_config(dict(QWEN2)), tmp_path_factory.mktemp("qwen2"))
        return qwen2

    return get


def _logits(model, tokens: list[int]) -> mx.array:
    return model(mx.array([tokens]))[0]  # (L, vocab)


def _reference(folder: Path, qtype: str):
    """mlx-lm's model of ``folder`` with every matrix replaced by its round trip through ``qtype``
    (computed by llama.cpp's numpy quantizers, not by MLX)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    model, tokenizer = load(str(folder))
    model.load_weights([(k, mx.array(dequantized(np.array(v), qtype)) if v.ndim == 2 else v)
                        for k, v in tree_flatten(model.parameters())])
    return model, tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_an_f32_gguf_computes_exactly_the_model_it_was_written_from(arch, hf_folder, tmp_path):
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load

    folder = hf_folder(arch)
    ours = load(str(write_gguf(folder, tmp_path / "model.gguf", "F32")))
    model, tokenizer = mlx_lm_load(str(folder))
    tokens = tokenizer.encode(PROMPT)
    assert ours.tokenizer.encode(PROMPT) == tokens
    # Same float32 weights, same operations: the llama q/k rows must be back in Hugging Face order exactly.
    assert mx.array_equal(_logits(ours.model, tokens), _logits(model, tokens))


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen3", "Q4_1"),
                                         ("qwen2", "Q8_0"), ("llama", "F16")])
def test_quantized_ggufs_stay_quantized_and_match_llama_cpp_dequantization(arch, qtype, hf_folder, tmp_path):
    import mlx.nn as nn

    from mlxkv.models import load

    folder = hf_folder(arch)
    ours = load(str(write_gguf(folder, tmp_path / "model.gguf", qtype)))
    quantized = [m for _, m in ours.model.named_modules() if isinstance(m, (nn.QuantizedLinear,
                                                                           nn.QuantizedEmbedding))]
    assert bool(quantized) == (qtype != "F16")
    if quantized:
        assert {m.bits for m in quantized} == {8 if qtype == "Q8_0" else 4}
        assert all(m.scales.dtype == mx.float32 for m in quantized)  # upcast on the CPU backend
    reference, tokenizer = _reference(folder, qtype)
    tokens = tokenizer.encode(PROMPT)
    ref = _logits(reference, tokens)
    # MLX stores a block's scale and (for Q4_0 / Q8_0) its bias -scale*2^(bits-1) in float16, llama.cpp's
    # numpy dequantizer in float32: each weight may differ by ~2^-11 of its block's scale.
    err = mx.abs(_logits(ours.model, tokens) - ref).max().item()
    assert err <= 2e-2 * mx.abs(ref).max().item(), err


def test_dequantize_gives_float_layers_equal_to_the_quantized_ones(hf_folder, tmp_path):
    import mlx.nn as nn

    from mlxkv.models import load

    path = str(write_gguf(hf_folder("llama"), tmp_path / "model.gguf", "Q4_1"))
    quantized, plain = load(path), load(path, dequantize=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in plain.model.named_modules())
    assert "quantization" not in plain.config
    tokens = plain.tokenizer.encode(PROMPT)
    a, b = _logits(quantized.model, tokens), _logits(plain.model, tokens)
    assert mx.allclose(a, b, rtol=1e-4, atol=1e-4 * mx.abs(a).max().item()).item()


def test_the_tokenizer_is_rebuilt_from_the_metadata(hf_folder, tmp_path):
    from mlx_lm.utils import load_tokenizer

    from mlxkv.models import load

    folder = hf_folder("llama")
    ours = load(str(write_gguf(folder, tmp_path / "model.gguf", "F32"))).tokenizer
    theirs = load_tokenizer(folder)
    import pydoc_data.topics as topics

    texts = [t for t in list(topics.topics.values())[:40]] + ["  leading spaces", "tabs\tand\nnew lines",
                                                              "unicode: ünïcödé ✓ 日本語", "<|user|> inline special"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text[:60]
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tuple?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.eos_token_ids == theirs.eos_token_ids and ours.bos_token == theirs.bos_token


def test_generate_on_a_gguf_file_and_on_a_folder_holding_it(hf_folder, tmp_path):
    folder = hf_folder("llama")
    (tmp_path / "only").mkdir()
    gguf = write_gguf(folder, tmp_path / "only" / "model.gguf", "F32")
    expected = runner.invoke(app, ["generate", "-m", str(folder), "--raw", "-n", "16", PROMPT])
    for spec in (str(gguf), str(gguf.parent)):
        result = runner.invoke(app, ["generate", "-m", spec, "--raw", "-n", "16", PROMPT])
        assert result.exit_code == 0, result.output
        assert result.stdout == expected.stdout and expected.stdout.strip()


def test_convert_writes_a_folder_mlx_lm_loads_with_the_same_outputs(hf_folder, tmp_path):
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load

    gguf = write_gguf(hf_folder("qwen3"), tmp_path / "model.gguf", "Q8_0")
    result = runner.invoke(app, ["convert", str(gguf), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["quantization"]["bits"] == 8
    model, tokenizer = mlx_lm_load(str(tmp_path / "out"))
    native = load(str(gguf))
    tokens = tokenizer.encode(PROMPT)
    assert native.tokenizer.encode(PROMPT) == tokens
    # mlx-lm keeps the stored float16 scales; mlxkv upcasts them on the CPU backend (exactly representable).
    from mlxkv.precision import upcast_on_cpu

    upcast_on_cpu(model)
    assert mx.array_equal(_logits(native.model, tokens), _logits(model, tokens))
    again = runner.invoke(app, ["convert", str(gguf), str(tmp_path / "out")])
    assert again.exit_code == 1 and "not an empty folder" in again.stderr


def _fails_with(spec: str, *fragments: str) -> None:
    result = runner.invoke(app, ["generate", "-m", spec, "--raw", "-n", "2", "hi"])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line and "Traceback" not in result.output, line
    for fragment in fragments:
        assert fragment in line, line


def test_bad_ggufs_fail_with_one_line(hf_folder, tmp_path):
    folder = hf_folder("llama")
    _fails_with(str(write_gguf(folder, tmp_path / "a.gguf", "F32", architecture="gpt2")), "'gpt2'", "llama")
    _fails_with(str(write_gguf(folder, tmp_path / "b.gguf", "F32", pre="made-up")), "'made-up'", "smollm")
    _fails_with(str(write_gguf(folder, tmp_path / "c.gguf", "F32", tokenizer=False)), "no tokenizer")
    _fails_with(str(write_gguf(folder, tmp_path / "d.gguf", "F32",
                               extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})), "rope_freqs")
    good = (tmp_path / "a.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:4096])
    _fails_with(str(tmp_path / "cut.gguf"), "not a readable GGUF file")
    (tmp_path / "fake.gguf").write_text("not a model")
    _fails_with(str(tmp_path / "fake.gguf"), "neither a folder nor a GGUF file")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("x.gguf", "y.gguf"):
        (two / name).write_bytes(good)
    _fails_with(str(two), "several GGUF files", "x.gguf, y.gguf")


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does():
    """A ``llama`` (SentencePiece BPE, byte fallback) vocabulary as llama.cpp's converter writes it (pieces,
    scores, token types), checked against the sentencepiece library on text it was not trained on."""
    import io

    spm = pytest.importorskip("sentencepiece")
    import pydoc_data.topics as topics

    from mlxkv.gguf.tokenizer import build_tokenizer

    texts = list(topics.topics.values())
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts[:60]), model_writer=proto, vocab_size=1200, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    ids = range(sp.get_piece_size())
    # llama.cpp's token types: 2 unknown, 3 control, 6 byte, 1 normal
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    tok = build_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in ids], "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    })
    for text in texts[60:] + ["In 2024, 12345 apples", "  two spaces", "ünïcödé ✓ 日本語 😀", "tabs\tand\nlines "]:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, text[:60]
        assert tok.decode(expected) == sp.decode(expected)
    assert tok.encode("hi")[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise


def test_convert_q_quantizes_as_mlx_lm_convert_does(hf_folder, tmp_path):
    """``mlxkv convert -q --q-bits 4 --q-group-size 32``: the written folder is the float model quantized by mlx-lm's
    own quantizer (logits equal the folder's model quantized by ``mlx_lm.utils.quantize_model``); its options are
    refused without ``-q`` or with ``--dequantize``, in one line."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import quantize_model

    gguf = write_gguf(hf_folder("qwen3"), tmp_path / "model.gguf", "F32")
    result = runner.invoke(app, ["convert", "-q", "--q-bits", "4", "--q-group-size", "32", str(gguf),
                                 str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    ours, tokenizer = mlx_lm_load(str(tmp_path / "out"))
    reference, _, reference_config = mlx_lm_load(str(hf_folder("qwen3")), return_config=True)
    reference, _ = quantize_model(reference, reference_config, 32, 4)
    tokens = tokenizer.encode(PROMPT)
    assert mx.array_equal(_logits(ours, tokens), _logits(reference, tokens))
    for argv, fragment in ((["--q-bits", "4"], "applies to -q"), (["-q", "--dequantize"], "exclude each other"),
                           (["-q", "--q-bits", "7"], "not one of")):
        refused = runner.invoke(app, ["convert", *argv, str(gguf), str(tmp_path / "other")])
        lines = refused.stderr.strip().splitlines()
        assert refused.exit_code == 2 and len(lines) == 1 and fragment in lines[0], refused.stderr
