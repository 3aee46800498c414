"""The offline test fixtures themselves: tiny architectures, the BPE tokenizer, the demo model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from testkit.archs import ARCH_NAMES, TEST_VOCAB_SIZE, build_model, get_config
from testkit.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

PROMPT = "The import statement is executed in two steps: find a module, then bind a name."

# The cache layout each architecture promises (what the other tests rely on).
EXPECTED_CACHES = {
    "llama": ["KVCache", "KVCache"],
    "qwen3": ["KVCache", "KVCache"],
    "gemma3_text": ["RotatingKVCache", "KVCache"],
    "llama4": ["ChunkedKVCache", "ChunkedKVCache", "ChunkedKVCache", "KVCache"],
    "deepseek_v3": ["KVCache", "KVCache"],
    "qwen3_next": ["ArraysCache", "KVCache"],
}


def _greedy_no_cache(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Reference greedy decoding: recompute the whole sequence at every step, no cache."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = int(mx.argmax(model(mx.array([seq]))[0, -1]).item())
        out.append(tok)
        if tok in eos:
            break
        seq.append(tok)
    return out


def test_every_arch_has_an_expected_layout():
    assert sorted(ARCH_NAMES) == sorted(EXPECTED_CACHES)


def test_unknown_arch_names_valid_options():
    with pytest.raises(ValueError, match="llama, qwen3"):
        get_config("gpt5")


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_loads_and_generates_like_uncached_reference(arch, test_model_dir):
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, tokenizer = load(str(test_model_dir(arch)))
    assert [type(c).__name__ for c in make_prompt_cache(model)] == EXPECTED_CACHES[arch]

    # loaded weights are bit-identical to the in-memory build, all float32
    built, _ = build_model(arch, seed=0)
    loaded = dict(tree_flatten(model.parameters()))
    expected = dict(tree_flatten(built.parameters()))
    assert loaded.keys() == expected.keys()
    for name, w in expected.items():
        assert loaded[name].dtype == mx.float32, name
        assert mx.array_equal(loaded[name], w).item(), name

    # 40 prompt tokens pass gemma3's 8-token window and llama4's 16-token chunks
    prompt = tokenizer.encode(PROMPT)
    assert 20 <= len(prompt) <= 40
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    assert len(tokens) >= 1
    assert tokens == _greedy_no_cache(model, prompt, 24, set(tokenizer.eos_token_ids))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_greedy_decoding_is_not_degenerate(arch):
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = build_model(arch, seed=0)
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(range(10, 50))]), cache=cache)
    out = []
    for _ in range(40):
        y = mx.argmax(logits[:, -1], axis=-1)
        out.append(int(y.item()))
        logits = model(y[:, None], cache=cache)
    assert len(set(out)) >= 15, out
    top2 = mx.sort(logits[0, -1])[-2:]
    assert (top2[1] - top2[0]).item() > 1e-4  # no near-ties for argmax to flip on


def test_build_model_is_deterministic_per_seed():
    a = dict(tree_flatten(build_model("llama", seed=0)[0].parameters()))
    b = dict(tree_flatten(build_model("llama", seed=0)[0].parameters()))
    c = dict(tree_flatten(build_model("llama", seed=1)[0].parameters()))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not mx.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"]).item()


def test_config_json_round_trips(test_model_dir):
    cfg = json.loads((test_model_dir("llama4") / "config.json").read_text())
    assert cfg == get_config("llama4")
    assert cfg["text_config"]["vocab_size"] == TEST_VOCAB_SIZE


# --- tokenizer ---------------------------------------------------------------------------------

TEXTS = [
    "The import statement",
    "  leading spaces, trailing tab\t\nand\r\nCRLF",
    "Unicode: “quotes” — é 日本語 🙂 Ωmega",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(test_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(test_model_dir("llama"))


def test_tokenizer_special_ids_and_size(tokenizer):
    assert len(tokenizer._tokenizer) == TEST_VOCAB_SIZE
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(t) == i
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {2}
    assert tokenizer.pad_token_id == 0


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert all(0 <= i < TEST_VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("text", [t for t in TEXTS if t and not t.startswith(" ")])
def test_streaming_detokenizer_matches_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer
    detok.reset()
    pieces = []
    for i in ids:
        detok.add_token(i)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert detok.text == text
    assert "".join(pieces) == text


def test_tokenizer_compresses_english_prose(tokenizer):
    text = "The basic import statement is executed in two steps: find a module, loading it if necessary."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2.5


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer(1024).to_str() == train_tokenizer(1024).to_str()
    with pytest.raises(ValueError, match="between 512 and 16384"):
        train_tokenizer(100)


def test_chat_template_renders(tokenizer, test_model_dir):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does import do?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat does import do?</s>\n<|assistant|>\n"
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert plain == text[: -len("<|assistant|>\n")]

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[:2] == [1, 3] and ids[-2] == 5  # <s> <|system|> ... <|assistant|> "\n"
    assert ids.count(1) == 1  # bos once: the template writes it, encoding adds none
    with pytest.raises(Exception, match="role must be system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    saved = json.loads((test_model_dir("llama") / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHAT_TEMPLATE


def test_make_test_models_cli(tmp_path):
    import importlib.util

    from mlx_lm.utils import load

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_test_models.py"
    spec = importlib.util.spec_from_file_location("make_test_models", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path), "--arch", "qwen3", "--seed", "3"]) == 0
    model, _ = load(str(tmp_path / "qwen3"))
    expected = dict(tree_flatten(build_model("qwen3", seed=3)[0].parameters()))
    loaded = dict(tree_flatten(model.parameters()))
    assert all(mx.array_equal(loaded[k], v).item() for k, v in expected.items())


# --- the shipped demo model --------------------------------------------------------------------

DEMO_DIR = Path(__file__).resolve().parents[1] / "mlxkv" / "demo_model"
DEMO_TRAIN_PASSAGE = """When the statement contains multiple clauses (separated by commas) the
two steps are carried out separately for each clause, just as though
the clauses had been separated out into individual import statements."""
DEMO_NEW_PASSAGE = """A module is loaded once and cached, so a second import of the same name
returns the object that the first import created, and the value of the
variable is not evaluated again unless the module is reloaded."""


def test_demo_model_folder_is_complete_and_small():
    names = {p.name for p in DEMO_DIR.iterdir()}
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "TRAINING.md"):
        assert required in names, required
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) < 9.5e6
    record = json.loads((DEMO_DIR / "training.json").read_text())
    assert record["saved_val_loss_float16"] < record["log"][0]["val_loss"]  # it learned something


def test_demo_model_writes_english_like_text():
    from mlx_lm.generate import generate
    from mlx_lm.utils import load

    model, tokenizer = load(str(DEMO_DIR))
    assert model.model.embed_tokens.weight.dtype == mx.float16
    assert model.args.vocab_size == len(tokenizer._tokenizer)

    def nll(text: str) -> float:
        ids = tokenizer.encode(text)
        logits = model(mx.array([ids[:-1]])).astype(mx.float32)  # (1, L, V)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -mx.take_along_axis(logp, mx.array([ids[1:]])[..., None], axis=-1).mean().item()

    seen = nll(DEMO_TRAIN_PASSAGE)  # from the "import" topic, a training topic
    unseen = nll(DEMO_NEW_PASSAGE)
    gibberish = nll("zq xv 1923 kettle umbrella purple violin #@! quantum banana drift")
    # uniform over 2048 tokens is 7.6 nats; measured at commit: 3.06, 4.72, 8.01
    assert seen < 3.8 and unseen < 5.5 and gibberish > unseen + 2.0, (seen, unseen, gibberish)

    text = generate(model, tokenizer, "The import statement", max_tokens=40)
    words = text.split()
    assert len(words) >= 10
    # mostly alphabetic words, not byte soup
    assert sum(w.strip(".,;:()\"'").isalpha() for w in words) >= 0.6 * len(words), text
