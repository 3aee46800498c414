"""Checks the parser can make before the model loads: text that is not UTF-8, options that need one another,
and options given where they would have no effect (refused rather than silently ignored)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter ``name`` (its Python name) was set on the command line or by an environment variable,
    not left at its default."""
    source = ctx.get_parameter_source(name)  # an enum of the click Typer runs on (by name: Typer vendors click)
    return getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def _not_utf8(text: str) -> Optional[str]:
    """Why ``text`` cannot be encoded as UTF-8, or ``None``. Python hands over undecodable argv and stdin bytes
    as lone surrogates (``surrogateescape``); this finds them before a tokenizer fails on them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        if "\udc80" <= bad <= "\udcff":  # an escaped byte
            return f"byte 0x{ord(bad) - 0xDC00:02x} at character {exc.start} is not valid UTF-8"
        return f"character U+{ord(bad):04X} at character {exc.start} is a lone surrogate, not valid UTF-8"
    return None


def check_utf8(value: Any) -> Any:
    """A Typer callback: the option's text (or each of a repeated option's) must be valid UTF-8."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and (why := _not_utf8(item)):
            raise typer.BadParameter(why)
    return value


def read_prompt(prompt: str) -> str:
    """The prompt argument, or standard input for ``-``, as text.

    Raises:
        ValueError: bytes that are not UTF-8 (from stdin or the argument), in one line.
    """
    if prompt != "-":
        if why := _not_utf8(prompt):
            raise ValueError(f"the prompt is not UTF-8 text: {why}")
        return prompt
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"standard input is not UTF-8 text: byte 0x{data[exc.start:exc.start + 1].hex()} "
                         f"at offset {exc.start}") from None


def read_prompt_file(path: str) -> str:
    """The text of the prompt file ``path``.

    Raises:
        ValueError: a file that is missing, a folder, unreadable or not UTF-8, in one line.
    """
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"--prompt-file {path}: is a folder, not a file")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"--prompt-file {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte 0x{data[exc.start:exc.start + 1].hex()} at "
                         f"offset {exc.start})") from None


def check_folder_option(value: Optional[str]) -> Optional[str]:
    """A Typer callback for an option naming a folder (created when missing): refuse an existing non-folder."""
    if value is not None:
        path = Path(value).expanduser()
        if path.exists() and not path.is_dir():
            raise typer.BadParameter(f"{value} is a file, not a folder")
        if not path.exists() and path.parent.exists() and not path.parent.is_dir():
            raise typer.BadParameter(f"{path.parent} is a file, not a folder")
    return value


def refuse_unused(ctx: typer.Context, rules: list[tuple[str, str, bool]]) -> None:
    """Refuse options given where they do nothing: ``rules`` holds ``(parameter, flag, applies)``; a parameter set
    by the user whose rule does not apply fails with ``flag`` and the reason in :data:`WHY`."""
    for name, flag, applies in rules:
        if not applies and given(ctx, name):
            raise typer.BadParameter(WHY[name], param_hint=flag)


def unused_sampling(temp: float) -> list[tuple[str, str, bool]]:
    """The :func:`refuse_unused` rules of the sampling options of ``generate`` and ``chat``: at ``--temp 0``
    decoding is greedy, so a seed and the filters of the distribution do nothing."""
    sampled = temp > 0
    return [("seed", "--seed", sampled), ("top_p", "--top-p", sampled), ("top_k", "--top-k", sampled),
            ("min_p", "--min-p", sampled)]


def check_stop(value: Any) -> Any:
    """A Typer callback for ``--stop``: UTF-8 text, and not empty (an empty stop string would match nothing)."""
    check_utf8(value)
    if any(item == "" for item in value or ()):
        raise typer.BadParameter("an empty stop string matches nothing: give the text to stop at")
    return value


def refuse_useless_dequantize(loaded: Any, dequantize: bool) -> None:
    """``--dequantize`` on a model stored unquantized would do nothing.

    Raises:
        ValueError: one line naming the option and the model.
    """
    if dequantize and not getattr(loaded, "quantized", True):
        raise ValueError(f"--dequantize has no effect: {loaded.name} has no quantized weights (drop --dequantize)")


def add_extra_eos(tokenizer: Any, tokens: Any) -> None:
    """``--extra-eos-token``: each token (its text as the vocabulary spells it, or an id) also ends an answer.

    Raises:
        ValueError: a token the vocabulary does not have, in one line.
    """
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for token in tokens or ():
        token_id = int(token) if token.isdigit() else vocab.get(token)
        if token_id is None or not 0 <= token_id < len(tokenizer):
            raise ValueError(f"--extra-eos-token {token!r} is not a token of this model's vocabulary")
        tokenizer.eos_token_ids = {*tokenizer.eos_token_ids, token_id}


#: Why an option has no effect where :func:`refuse_unused` refuses it.
_GREEDY = "has no effect at --temp 0 (greedy decoding draws nothing at random): raise --temp or drop "
WHY = {
    "seed": _GREEDY + "--seed",
    "top_p": _GREEDY + "--top-p",
    "top_k": _GREEDY + "--top-k",
    "min_p": _GREEDY + "--min-p",
    "num_draft_tokens": "needs a drafting mode: --draft-model or --prompt-lookup",
    "ngram_size": "applies to --prompt-lookup only",
    "kv_group_size": "applies to a quantized KV cache only: add --kv-bits 4 or 8",
    "kv_block_size": "applies to the paged backend only: add --kv-backend paged",
    "state_snapshot_interval": "applies to the paged backend only: add --kv-backend paged",
}


def check_adapter_option(value: Optional[str]) -> Optional[str]:
    """A Typer callback for ``--adapter-path``: a folder holding an adapter in mlx-lm's format (its files and
    config; whether it fits the model is known once the model loads)."""
    if value is not None:
        from mlxkv.adapters import AdapterError, check_adapter_folder

        try:
            check_adapter_folder(value)
        except AdapterError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def check_file_option(value: Optional[str]) -> Optional[str]:
    """A Typer callback for an option naming a file that must exist."""
    if value is not None and not Path(value).expanduser().is_file():
        raise typer.BadParameter(f"{value} is a folder, not a file" if Path(value).expanduser().is_dir()
                                 else f"no such file: {value}")
    return value


def check_files_option(values: Optional[list[str]]) -> Optional[list[str]]:
    """A Typer callback for a repeatable option naming files that must exist."""
    for value in values or ():
        check_file_option(value)
    return values


def check_draft_model(spec: str) -> None:
    """A draft model that is not there fails now, named as the draft, not after the model it drafts for has loaded.

    Raises:
        ValueError: naming ``--draft-model`` and why it cannot be found.
    """
    from mlxkv.models import ModelLoadError, resolve_model_path

    try:
        resolve_model_path(spec)
    except ModelLoadError as exc:
        raise ValueError(f"--draft-model {spec}: {exc}") from None


__all__ = ["check_files_option", "given", "check_utf8", "check_stop", "read_prompt", "check_folder_option",
           "check_file_option", "refuse_unused", "unused_sampling", "refuse_useless_dequantize", "add_extra_eos",
           "check_adapter_option", "check_draft_model", "WHY"]
