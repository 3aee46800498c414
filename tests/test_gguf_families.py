"""GGUF families beyond llama / qwen: Gemma 2, Gemma 3, Phi-3 and Mistral-Nemo-style llama (explicit head_dim),
each written as llama.cpp's converter writes it (``tests/testkit/gguf_files.py``: the gguf package's name map,
Gemma's norms stored as 1 + w, the family's metadata) from a random-weight Hugging Face folder, and loaded back
as the model mlx-lm loads from that folder: equal logits, and ``mlxkv generate`` gives the folder's greedy text.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlxkv.cli.main import app
from typer.testing import CliRunner

pytest.importorskip("gguf")
runner = CliRunner()
# longer than the Gemma test models' sliding window (8 tokens), so local and global layers differ
PROMPT = "Lists are mutable sequences, typically used to store collections of homogeneous items"

_COMMON = {"vocab_size": 1024, "max_position_embeddings": 4096, "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
FAMILIES = {
    # Mistral-Nemo: llama with head_dim (32) wider than hidden / heads (16)
    "mistral_nemo": {**_COMMON, "model_type": "llama", "num_hidden_layers": 2, "head_dim": 32,
                     "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "gemma2": {**_COMMON, "model_type": "gemma2", "num_hidden_layers": 2, "head_dim": 16,
               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 8, "rope_theta": 10000.0},
    # six layers: llama.cpp's converter writes no pattern for Gemma 3, its loader assumes a global layer every 6
    "gemma3": {**_COMMON, "model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16,
               "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 6,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0},
    "phi3": {**_COMMON, "model_type": "phi3", "num_hidden_layers": 2, "rope_theta": 10000.0,
             "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``family(name) -> (folder, gguf)``, each written once."""
    from testkit.archs import build_from_config
    from testkit.gguf_files import write_gguf
    from testkit.models import write_model

    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(name: str):
        if name not in built:
            folder = write_model(*build_from_config(dict(FAMILIES[name])), root / name)
            built[name] = (folder, write_gguf(folder, root / f"{name}.gguf", "F32"))
        return built[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_loads_as_mlx_lm_loads_its_folder(name, family):
    from mlx_lm.utils import load as mlx_lm_load

    from mlxkv.models import load

    folder, path = family(name)
    ours = load(str(path))
    model, tokenizer = mlx_lm_load(str(folder))
    assert ours.config["model_type"] == FAMILIES[name]["model_type"]
    tokens = tokenizer.encode(PROMPT)
    assert len(tokens) > 8 and ours.tokenizer.encode(PROMPT) == tokens
    a, b = ours.model(mx.array([tokens]))[0], model(mx.array([tokens]))[0]
    # float32 both sides, the same weights (Gemma's 1 + w comes back exactly); mlxkv's CPU ops (table RoPE, fused
    # projections) may round differently in the last bits
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5 * mx.abs(b).max().item()).item()
    result = runner.invoke(app, ["generate", "-m", str(path), "--raw", "-n", "16", PROMPT])
    expected = runner.invoke(app, ["generate", "-m", str(folder), "--raw", "-n", "16", PROMPT])
    assert result.exit_code == 0 and expected.exit_code == 0, result.output + expected.output
    # the same tokens; mlx-lm streams a folder's byte-level BPE text without the first token's leading space
    # (BPEStreamingDetokenizer), a GGUF's tokenizer streams it as decoded
    assert result.stdout.lstrip(" ") == expected.stdout.lstrip(" ") and expected.stdout.strip()


def test_config_keys_follow_llama_cpp_s_rules(family):
    from mlxkv.gguf.load import translate

    config = translate(family("gemma3")[1]).config
    assert (config["sliding_window"], config["sliding_window_pattern"], config["rope_local_base_freq"],
            config["query_pre_attn_scalar"]) == (8, 6, 10000.0, 16)
    config = translate(family("gemma2")[1]).config
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert translate(family("mistral_nemo")[1]).config["head_dim"] == 32


def test_other_architectures_and_longrope_are_refused_in_one_line(family, tmp_path):
    from testkit.gguf_files import write_gguf

    folder, _ = family("phi3")

    def fails(path, *fragments):
        result = runner.invoke(app, ["generate", "-m", str(path), "--raw", "-n", "2", "hi"])
        line = result.stderr.strip()
        assert result.exit_code == 1 and line.startswith("error: ") and "\n" not in line, result.output
        for fragment in fragments:
            assert fragment in line, line

    fails(write_gguf(folder, tmp_path / "a.gguf", "F32", architecture="falcon"), "'falcon'", "gemma3", "phi3")
    gemma3, _ = family("gemma3")
    fails(write_gguf(gemma3, tmp_path / "c.gguf", "F32", extra_metadata={"gemma3.attention.sliding_window_pattern": 7}),
          "sliding_window_pattern is 7", "6 layers")
    import numpy as np

    fails(write_gguf(folder, tmp_path / "b.gguf", "F32",
                     extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)}), "LongRoPE")


@pytest.mark.parametrize("merges", [["a c"], ["ab"]])
def test_a_vocabulary_the_tokenizers_library_rejects_is_one_gguf_error(merges):
    """A corrupted vocabulary (a merge naming a token the vocabulary lacks, a merge that is not a pair) ends in the
    loader's one-line error, not the tokenizers library's exception (found by flipping header bytes)."""
    from mlxkv.gguf.reader import GGUFError
    from mlxkv.gguf.tokenizer import build_tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": merges}
    with pytest.raises(GGUFError, match="gpt2 tokenizer cannot be built"):
        build_tokenizer(meta)
