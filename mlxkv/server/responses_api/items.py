"""A Responses request's input items, tools and output format in the chat form the rest of the server reads.

Input items become OpenAI chat messages (then :func:`mlxkv.server.tools.to_template_messages` makes them the chat
template's): a message item (or the short ``{"role", "content"}`` form) keeps its role and its text parts
(``input_text``, an assistant's ``output_text``; a ``refusal`` part reads as its text); a user message's
``input_image`` parts (``image_url``: a data URL, or a ``file://`` URL under ``--allowed-image-dir``) become chat
``image_url`` parts, read as the chat route reads them (docs/vision.md); consecutive
``function_call`` items join the assistant turn before them as its ``tool_calls``; a ``function_call_output`` is a
``tool`` message. ``reasoning`` items are dropped: chat templates do not render earlier turns' reasoning (the
model's own thinking from a stored response lives on in the KV cache instead, see :mod:`.store`). Anything else
(files, audio, images by ``file_id``, item references, built-in tool calls) is refused with a 400 naming the item.

Function tools are flat in this API (``{"type": "function", "name", "description", "parameters", "strict"}``) and
nested in chat's; ``tool_choice`` ``{"type": "function", "name"}`` likewise. ``text.format`` becomes chat's
``response_format``. A function's ``strict`` is what the request says (omitted: not strict).
"""

from __future__ import annotations

import json
from typing import Any

from mlxkv.server.errors import APIError

#: Content part types read as text, by the item role they may appear in.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
#: Fields an item may carry that change nothing about its meaning (ids and statuses echoed back by clients).
_ECHOED = {"id", "status", "type"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_value", param)


def _image_part(part: dict, at: str, role: str) -> dict[str, Any]:
    """An ``input_image`` part as a chat ``image_url`` part."""
    if role != "user":
        raise _bad(f"{at}: input_image parts belong to user messages", f"{at}.type")
    if part.get("file_id") is not None:
        raise APIError(400, f"{at}: images by file_id are not supported (there is no file store): send image_url "
                       "as a data URL", "unsupported_content", f"{at}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{at}: image_url must be a string (a data URL)", f"{at}.image_url")
    extra = set(part) - {"type", "image_url", "detail", "file_id"}
    if extra:
        raise _bad(f"{at}: unknown field {sorted(extra)[0]!r}", f"{at}.{sorted(extra)[0]}")
    return {"type": "image_url", "image_url": {"url": url}}


def _text(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """A content's text; with ``input_image`` parts, chat content parts (text and ``image_url``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of content parts", where)
    texts = []
    parts: list[dict[str, Any]] = []
    for p, part in enumerate(content):
        at = f"{where}.{p}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image_part(part, at, role))
            continue
        if kind not in _TEXT_PARTS:
            what = "file and audio input are not supported" if kind in (
                "input_file", "input_audio") else f"content parts of type {kind!r} are not supported"
            raise APIError(400, f"{at}: {what}", "unsupported_content", f"{at}.type")
        if kind != "input_text" and role != "assistant":
            raise _bad(f"{at}: {kind} parts belong to assistant messages", f"{at}.type")
        value = part.get(_TEXT_PARTS[kind])
        if not isinstance(value, str):
            raise _bad(f"{at}: {_TEXT_PARTS[kind]} must be a string", f"{at}.{_TEXT_PARTS[kind]}")
        texts.append(value)
        parts.append({"type": "text", "text": value})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(texts)


def _check_fields(item: dict, allowed: set[str], where: str) -> None:
    for key in item:
        if key not in allowed | _ECHOED:
            raise _bad(f"{where}: unknown field {key!r}", f"{where}.{key}")


def to_chat_messages(input_: Any, instructions: str | None = None) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` (a string or items) as OpenAI chat messages (``instructions``: a leading
    ``system`` message).

    Raises:
        APIError: 400 naming the item (``input.N...``) for what cannot be read or is not supported.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(input_messages(input_))
    return messages


def input_messages(input_: Any) -> list[dict[str, Any]]:
    """``input`` alone as OpenAI chat messages (see :func:`to_chat_messages`)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"{where}: an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            _check_fields(item, {"role", "content", "phase"}, where)
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}: role must be user, assistant, system or developer, got {role!r}",
                           f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content", role)})
        elif kind == "function_call":
            _check_fields(item, {"call_id", "name", "arguments", "namespace"}, where)
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{where}: {key} must be a string", f"{where}.{key}")
            if item.get("namespace") is not None:
                raise APIError(400, f"{where}: namespaced function calls are not supported", "unsupported_value",
                               f"{where}.namespace")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item["arguments"], where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_fields(item, {"call_id", "output"}, where)
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: call_id must be a string", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output", "tool")})
        elif kind == "reasoning":
            _check_fields(item, {"summary", "content", "encrypted_content"}, where)
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", "unsupported_value",
                           f"{where}.type")
    if not any(m["role"] != "system" and m["role"] != "developer" for m in out):
        raise _bad("input: the conversation has no user, assistant or tool turn", "input")
    return out


def _arguments(raw: str, where: str) -> str:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise _bad(f"{where}: arguments are not valid JSON: {exc}", f"{where}.arguments") from None
    if not isinstance(value, dict):
        raise _bad(f"{where}: arguments must be a JSON object", f"{where}.arguments")
    return raw


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's nested form (``None``: none sent).

    Raises:
        APIError: 400 naming the tool for a non-function tool (built-in tools are OpenAI's hosted services) or a
            malformed one.
    """
    if tools is None:
        return None
    out = []
    for t, tool in enumerate(tools):
        where = f"tools.{t}"
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"{where}: tools of type {kind!r} are not supported (function tools only)",
                           "unsupported_value", f"{where}.type")
        _check_fields(tool, {"name", "description", "parameters", "strict", "defer_loading"}, where)
        if tool.get("defer_loading"):
            raise APIError(400, f"{where}: defer_loading is not supported", "unsupported_value",
                           f"{where}.defer_loading")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}: name must be a non-empty string", f"{where}.name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}: parameters must be a JSON Schema object", f"{where}.parameters")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise _bad(f"{where}: description must be a string", f"{where}.description")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _bad(f"{where}: strict must be true or false", f"{where}.strict")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in chat's form (``None``: not sent).

    Raises:
        APIError: 400 for a choice naming a tool type other than function.
    """
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools":
        raise APIError(400, "tool_choice: allowed_tools is not supported", "unsupported_value", "tool_choice")
    raise _bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``None``: text).

    Raises:
        APIError: 400 naming ``text.format`` for an unknown type or a json_schema without its schema.
    """
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            extra = sorted(set(fmt) - {"type"})[0]
            raise _bad(f"text.format: unknown field {extra!r}", f"text.format.{extra}")
        return {"type": kind}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise _bad(f"text.format: unknown field {sorted(extra)[0]!r}", f"text.format.{sorted(extra)[0]}")
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format: a json_schema format needs its schema (an object)", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        spec.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")
