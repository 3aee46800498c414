"""A tokenizer's chat template and tool-call format: a Jinja template file used instead of the model's, and the
mlx-lm tool parser that reads the calls the template teaches the model to write.

mlx-lm picks a tool parser when it loads a Hugging Face folder (``tool_parser_type`` in tokenizer_config.json, or
inferred from the template's markers by ``mlx_lm.tokenizer_utils._infer_tool_parser``). A template given on the
command line, or a GGUF file's tokenizer (built by :mod:`mlxkv.gguf`, not by mlx-lm's loader), needs that choice
made again; :func:`with_chat_template` makes it the way mlx-lm does, or takes a parser named by the user.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

#: Largest chat template file read (real templates are a few KB; the largest known ~40 KB).
MAX_TEMPLATE_BYTES = 1 << 20


def read_chat_template(path: str | Path) -> str:
    """The text of a Jinja chat template file, checked to compile.

    Raises:
        ValueError: the file is missing, unreadable, empty, too large, or not valid Jinja.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"chat template not found: no such file: {path}")
    if file.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"chat template {path} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"chat template {path} is empty")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers renders templates in this environment; a syntax error is one line now, not per request
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {path} is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    return text


def tool_parser_names() -> tuple[str, ...]:
    """The tool parsers mlx-lm ships (modules of ``mlx_lm.tool_parsers`` with a ``parse_tool_call``)."""
    spec = importlib.util.find_spec("mlx_lm.tool_parsers")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None:
        return ()
    names = []
    for file in sorted(folder.glob("*.py")):
        if not file.stem.startswith("_") and "def parse_tool_call" in file.read_text(encoding="utf-8"):
            names.append(file.stem)
    return tuple(names)


def check_tool_parser(name: str | None) -> None:
    """Raises ``ValueError`` naming the valid choices unless ``name`` is None or one of :func:`tool_parser_names`."""
    if name is not None and name not in (names := tool_parser_names()):
        raise ValueError(f"unknown tool parser {name!r}: expected one of {', '.join(names)}")


def _parser_module(name: str) -> Any:
    check_tool_parser(name)
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


def tool_parser_name(tokenizer: Any) -> str | None:
    """The name of the mlx-lm tool parser ``tokenizer`` uses (``json_tools``, ...), or None without one."""
    parse = getattr(tokenizer, "tool_parser", None)
    module = getattr(parse, "__module__", "") or ""
    return module.rpartition(".")[2] if module.startswith("mlx_lm.tool_parsers.") else None


def with_chat_template(tokenizer: Any, template: str | None = None, tool_parser: str | None = None) -> Any:
    """``tokenizer`` (mlx-lm's ``TokenizerWrapper``) rendering chats with ``template`` and reading tool calls with
    the mlx-lm parser named ``tool_parser`` (by default, the one mlx-lm infers from the template in use).

    Returns ``tokenizer`` itself when nothing changes, else a new wrapper around the same Hugging Face tokenizer
    (whose ``chat_template`` is then ``template``).

    Raises:
        ValueError: ``tool_parser`` is not one of :func:`tool_parser_names`.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper, _infer_tool_parser

    module = _parser_module(tool_parser) if tool_parser else None
    hf = tokenizer._tokenizer
    if template is not None:
        hf.chat_template = template
    if module is None and (template is not None or not tokenizer.has_tool_calling):
        inferred = _infer_tool_parser(hf)  # mlx-lm's own detection, over the template now in use
        module = importlib.import_module(f"mlx_lm.tool_parsers.{inferred}") if inferred else None
    if template is None and module is None:
        return tokenizer
    parser = (module.parse_tool_call, module.tool_call_start, module.tool_call_end) if module else (None,) * 3
    # A model-specific renderer (mlx-lm's chat_templates modules) stays unless a template file replaces it.
    renderer = None if template is not None else getattr(tokenizer, "_chat_template", None)
    return TokenizerWrapper(hf, detokenizer_class=lambda _: tokenizer.detokenizer,
                            eos_token_ids=tokenizer.eos_token_ids, chat_template=renderer,
                            tool_parser=parser[0], tool_call_start=parser[1], tool_call_end=parser[2],
                            response_format=getattr(tokenizer, "_response_format", None))
