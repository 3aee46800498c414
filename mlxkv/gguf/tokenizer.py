"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library.

Supported: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE from the file's vocabulary and merges) with the
pre-tokenizer ``tokenizer.ggml.pre`` names (the split rules the merges were learned with, as llama.cpp
defines them), and ``llama`` (SentencePiece BPE with byte fallback, merges recovered from the scores).
Control tokens become special tokens, user-defined ones added tokens; the chat template, BOS / EOS and the
add-BOS flag come from the metadata.
"""

from __future__ import annotations

import os
from typing import Any

from mlxkv.gguf.reader import GGUFError

# ggml token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the regular expressions that split text before byte-level BPE, applied in order
#: (llama.cpp's ``llama_vocab`` pre-tokenizer table for these names).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``transformers`` fast tokenizer (what mlx-lm wraps) for the tokenizer in ``meta``.

    Raises:
        GGUFError: no tokenizer in the metadata, or a model / pre-tokenizer type mlxkv does not build.
    """
    # mlx-lm silences transformers' advisory line about PyTorch when it is imported; this may run first.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import PreTrainedTokenizerFast

    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("this GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    kind = meta.get("tokenizer.ggml.model")
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported (mlxkv builds 'gpt2' and 'llama' tokenizers)")
    try:
        backend = _byte_level_bpe(tokens, meta) if kind == "gpt2" else _sentencepiece_bpe(tokens, types, meta)
        _add_special_tokens(backend, tokens, types)
    except GGUFError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad vocabulary
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GGUFError(f"the GGUF file's {kind} tokenizer cannot be built: {first[:200]}") from None

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _post_processor(backend, bos if add_bos else None, eos if add_eos else None)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(
            f"GGUF pre-tokenizer {pre!r} is not supported; mlxkv knows {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[int], meta: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, types, scores), fuse_unk=True,
                               byte_fallback=True, unk_token=tokens[int(unk)] if unk is not None else None))
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(content=" ", left=1, right=0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *strip])
    return tok


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a normal token into two tokens of the
    vocabulary, best-scored result first (SentencePiece merges the highest-scoring pair)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    found = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                found.append((-scores[i], normal[left], normal[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _post_processor(tok: Any, bos: str | None, eos: str | None) -> None:
    from tokenizers import processors

    if bos is None and eos is None:
        return
    single = " ".join(p for p in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if p)
    pair = " ".join(p for p in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if p)
    special = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
