"""A byte-level BPE tokenizer trained offline on prose that ships with every Python install.

The corpus is the standard library's ``pydoc_data.topics`` (the language reference sections that
``help("import")`` prints; PSF license): about 465 KB of English prose with code samples. Byte-level
BPE means any text encodes, and ``decode(encode(text)) == text`` exactly.

Token ids 0-5 are fixed whatever the vocabulary size::

    0 <pad>   1 <s> (bos)   2 </s> (eos, also ends each chat turn)
    3 <|system|>   4 <|user|>   5 <|assistant|>

The written folder (``write_tokenizer``) is what mlx-lm's ``load_tokenizer`` and transformers'
``PreTrainedTokenizerFast`` expect: tokenizer.json, tokenizer_config.json (with a Jinja chat template)
and special_tokens_map.json. mlx-lm picks its ``BPEStreamingDetokenizer`` for it (ByteLevel decoder).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLES = ("system", "user", "assistant")
#: Special tokens in id order: ids 0..5.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS) + tuple(f"<|{r}|>" for r in ROLES)

#: Chat template: ``<s>`` once, then per message ``<|role|>\n{content}</s>\n``; with
#: ``add_generation_prompt`` it ends with ``<|assistant|>\n``. Unknown roles raise.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_documents() -> list[str]:
    """The training prose: every ``pydoc_data.topics`` entry, in sorted key order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_documents(), trainer=trainer)
    # plain encode() prepends <s>, as Llama-style tokenizers do; chat templates write it themselves
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}, want {i}"
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def train_tokenizer(vocab_size: int = 1024):
    """Train (once per process and size) the byte-level BPE tokenizer; returns a ``tokenizers.Tokenizer``.

    Raises:
        ValueError: if ``vocab_size`` is below 512 (the 256 byte symbols, the special tokens and room
            for merges) or above 16384 (the corpus cannot fill more).
    """
    from tokenizers import Tokenizer

    if not 512 <= vocab_size <= 16384:
        raise ValueError(f"vocab_size must be between 512 and 16384, got {vocab_size}")
    return Tokenizer.from_str(_trained_json(vocab_size))


def tokenizer_config(model_max_length: int = 4096) -> dict:
    """The tokenizer_config.json contents (transformers ``PreTrainedTokenizerFast``)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: str | Path, vocab_size: int = 1024, model_max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``.

    Returns:
        ``out_dir`` as a ``Path`` (created if missing).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size)  # validates vocab_size
    (out / "tokenizer.json").write_text(_trained_json(vocab_size), encoding="utf-8")
    config = tokenizer_config(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return out


THINK_START, THINK_END = "<think>", "</think>"
#: The chat template of :func:`write_thinking_tokenizer`: :data:`CHAT_TEMPLATE`'s turns, and a generation prompt that
#: opens a think block (DeepSeek-R1 style) unless ``enable_thinking`` is false, when it writes an empty one (Qwen3's
#: way of turning thinking off).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


def write_thinking_tokenizer(out_dir: str | Path, vocab_size: int = 1024, model_max_length: int = 4096) -> Path:
    """Like :func:`write_tokenizer` (same size, so it fits the same test models), but its last two ids are the think
    markers ``<think>`` and ``</think>`` (so mlx-lm's ``TokenizerWrapper.has_thinking`` is true) and its chat template
    is :data:`THINKING_TEMPLATE`."""
    from tokenizers import AddedToken, Tokenizer

    out = write_tokenizer(out_dir, vocab_size=vocab_size - 2, model_max_length=model_max_length)
    tok = Tokenizer.from_str(_trained_json(vocab_size - 2))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    assert tok.token_to_id(THINK_END) == vocab_size - 1, tok.token_to_id(THINK_END)
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = {**tokenizer_config(model_max_length), "chat_template": THINKING_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
