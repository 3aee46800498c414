"""The Responses routes: ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``.

A request is translated into the chat form (:mod:`.items`) and goes through the server's one request preparation
(:mod:`mlxkv.server.preparation`: the chat template, the grammar of ``text.format`` and forced or strict tool
calls, the overflow policy) and the same engine outcomes as the other routes (:mod:`mlxkv.server.generation`).

``previous_response_id`` continues a stored response (:mod:`.store`): its conversation comes first, then the new
input. The prompt starts with the stored response's very tokens (its prompt and output, whose KV blocks are
retained), so the prefix cache serves them and only the new input is prefilled: when the chat template renders
the stored turn as the text those tokens decode to, the new prompt is those tokens followed by the rest of the
rendering, tokenized; otherwise (a template that rewrites earlier turns, a stop string cut from the text) the
whole rendering, whose common start the cache still serves.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from mlxkv.config import SamplingDefaults
from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import GenerationRequest, RequestHandle, Usage
from mlxkv.engine.sampling import SamplingParams
from mlxkv.server.choice_output import ChoiceOutput
from mlxkv.server.compat import KEEPALIVE_EVENT
from mlxkv.server.errors import APIError
from mlxkv.server.generation import bursts, collect, failure
from mlxkv.server.image_parts import has_images, take_openai_images
from mlxkv.server.preparation import Constraint, Prepared, Preparation, PromptSource, tool_error
from mlxkv.server.reasoning import splitter_for
from mlxkv.server.responses_api.items import chat_tool_choice, chat_tools, input_messages, response_format
from mlxkv.server.responses_api.output import ResponseOutput, new_id
from mlxkv.server.responses_api.schemas import ResponsesRequest
from mlxkv.server.responses_api.store import ResponseStore, StoredResponse, StoreConfig, tenant_of
from mlxkv.server.schemas import CacheFields
from mlxkv.server.sampling_args import DEFAULT_CHAT_TOKENS
from mlxkv.server.structured_output import forces_call
from mlxkv.server.tenancy import request_tenant
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.tools import (
    ToolRequestError,
    check_template_renders_tools,
    render_tools,
    to_template_messages,
    tools_in_use,
)
from mlxkv.structured import parse_response_format

#: ``reasoning.effort`` values that turn a thinking template's thinking off.
NO_THINKING = ("none", "minimal")


def store_for(engine: BatchEngine, config: StoreConfig | None = None) -> ResponseStore:
    """A response store sized against ``engine``'s paged pool (read once, before the engine thread runs)."""
    paged = getattr(getattr(engine, "pool", None), "paged", None)
    bytes_per_block = getattr(paged, "bytes_per_block", None)
    block_size = getattr(paged, "block_size", None)
    per_token = bytes_per_block / block_size if bytes_per_block and block_size else None
    pool_bytes = bytes_per_block * paged.num_blocks if per_token else None
    return ResponseStore(config or StoreConfig(), per_token, pool_bytes)


def responses_router(engine: BatchEngine, prep: Preparation, *, model_name: str, store: ResponseStore,
                     keepalive_s: float | None = None, defaults: SamplingDefaults | None = None) -> APIRouter:
    """The Responses routes over ``engine`` (mount under ``/v1``, behind the API-key check).

    Args:
        engine: the batch engine.
        prep: the app's request preparation (shared with the other routes).
        model_name: the model id reported in responses.
        store: the stored responses (:func:`store_for`).
        keepalive_s: a stream silent this long gets a keep-alive comment (``None``: none).
        defaults: the server's sampling defaults and chat-template variables.
    """
    defaults = defaults or SamplingDefaults()
    tokenizer = engine.tokenizer
    has_template = bool(getattr(tokenizer, "chat_template", None))
    no_tools = check_template_renders_tools(tokenizer) if has_template else None
    router = APIRouter(tags=["responses"])

    def tenant(request: Request) -> str:
        return tenant_of(request_tenant(request).name, None)

    @router.post("/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API: one response, whole or streamed, stored unless ``store`` is false."""
        if not has_template:
            raise APIError(400, "this model's tokenizer has no chat template", "no_chat_template")
        owner = tenant(request)
        parent = None
        if body.previous_response_id is not None:
            parent = store.get(body.previous_response_id, owner)
            if parent is None or parent.salt != body.cache_salt:
                raise APIError(404, f"no stored response {body.previous_response_id!r}", "previous_response_not_found",
                               "previous_response_id")
            if parent.holds_images:
                raise APIError(400, "previous_response_id: that response held images, which are not stored: send "
                               "its conversation again, with its images, as input", "unsupported_value",
                               "previous_response_id")
        new_input = input_messages(body.input)
        images = None
        if has_images(new_input, None):  # decoded off the event loop; each image_url part becomes its marker text
            images = await prep.lanes.on_worker(lambda: take_openai_images(prep.vision, new_input, None, "input"))
        conversation = (list(parent.messages) if parent else []) + new_input
        tools, tool_choice = chat_tools(body.tools), chat_tool_choice(body.tool_choice)
        parallel = body.parallel_tool_calls is not False
        try:
            use_tools = tools_in_use(tools, tool_choice)
            system = [{"role": "system", "content": body.instructions}] if body.instructions else []
            messages = to_template_messages(system + conversation)
        except ToolRequestError as exc:
            raise tool_error(exc) from None
        if use_tools and no_tools:
            raise APIError(400, no_tools, "tools_unsupported", "tools")
        if no_tools and any(m.get("tool_calls") for m in messages):
            raise APIError(400, f"function calls in the input: {no_tools}", "tools_unsupported", "input")
        kwargs = dict(defaults.chat_template_kwargs)
        if body.reasoning is not None and body.reasoning.effort is not None and getattr(tokenizer, "has_thinking",
                                                                                       False):
            kwargs["enable_thinking"] = body.reasoning.effort not in NO_THINKING
        if use_tools:
            kwargs["tools"] = render_tools(tools)
        source = PromptSource(messages=messages, template_kwargs=kwargs, param="input", images=images)
        fmt = _format(body)
        if use_tools and forces_call(tool_choice):
            # the answer is the forced call(s), no text: text.format has nothing to shape in this response (OpenAI
            # takes both; the format applies to a later turn's text, as agents send it every turn)
            fmt = parse_response_format(None)
        prepared = await prep.prepare(source, Constraint(fmt, tools if use_tools else None, tool_choice, parallel),
                                      tenant=request_tenant(request), body=CacheFields(cache_salt=body.cache_salt,
                                                                                  speculative=body.speculative))
        if parent is not None and parent.tokens and not images:  # image spans index prepared.prompt's own tokens
            continued = await _continued(prep, parent, source, prepared.prompt)
            if continued is not prepared.prompt:  # message ends were found in the other tokenization
                prepared = dataclasses.replace(prepared, prompt=continued, snapshot_at=())
        prompt = prepared.prompt
        response_id = new_id("resp_")
        retention = store.retain(response_id, len(prompt), parent.id if parent else None) if body.store else None
        params = _sampling(body, defaults, len(prompt), engine.context_length)

        def build(p: Prepared) -> GenerationRequest:
            return p.request(params, retention=retention)  # the salts are the tenant's (preparation)

        try:
            handle = prep.submit(prepared, build)
        except APIError:
            store.release(response_id)
            raise
        choice = ChoiceOutput(splitter_for(tokenizer, prompt), None,
                              ToolOutput(tokenizer, tools, 1, parallel=parallel) if use_tools else None, 0)
        output = ResponseOutput(_envelope(response_id, body, model_name, params, parallel), choice)

        def keep(usage: Usage) -> None:
            """Store the finished response (when asked to)."""
            if not body.store:
                return
            kv = prompt + output.tokens
            store.put(StoredResponse(response_id, owner, body.cache_salt, output.body(output.status, usage),
                                     conversation + [output.assistant_message()], kv, holds_images=bool(images)))
            store.settle(response_id, len(kv))

        if body.stream:
            return StreamingResponse(_events(handle, output, keep, store, len(prompt), keepalive_s),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        events = await collect(request, handle)
        if events is None:
            store.release(response_id)
            return Response(status_code=499)  # the client is gone; nobody reads it
        if events[-1].kind != "done":
            store.release(response_id)
            raise failure(events[-1])
        for event in events[:-1]:
            output.feed(event)
        usage = events[-1].usage or Usage(len(prompt), len(output.tokens))
        answer = output.whole(usage)
        keep(usage)
        return answer

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        """A stored response (404 for an unknown id, or another API key's)."""
        stored = store.get(response_id, tenant(request))
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_not_found", "response_id")
        return stored.body

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        """Drop a stored response: it can no longer be read nor continued."""
        if not store.delete(response_id, tenant(request)):
            raise APIError(404, f"no stored response {response_id!r}", "response_not_found", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router


def _format(body: ResponsesRequest) -> Any:
    """``text.format`` compiled (400 naming ``text.format`` when it cannot be enforced)."""
    try:
        return parse_response_format(response_format(body.text.format if body.text else None))
    except ValueError as exc:
        raise APIError(400, str(exc).replace("response_format", "text.format"), "invalid_value", "text.format") \
            from None


def _sampling(body: ResponsesRequest, defaults: SamplingDefaults, prompt_tokens: int,
              context_length: int | None) -> SamplingParams:
    wanted = body.max_output_tokens if body.max_output_tokens is not None else defaults.max_tokens
    if wanted is None:
        wanted = max(1, (context_length or DEFAULT_CHAT_TOKENS + prompt_tokens) - prompt_tokens)
    try:
        return SamplingParams(max_tokens=wanted, temp=defaults.temp if body.temperature is None else body.temperature,
                              top_p=defaults.top_p if body.top_p is None else body.top_p, top_k=defaults.top_k,
                              min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from None


def _envelope(response_id: str, body: ResponsesRequest, model_name: str, params: SamplingParams,
              parallel: bool) -> dict[str, Any]:
    """The response object's echo of its request."""
    reasoning = body.reasoning
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model_name,
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": parallel,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "store": body.store, "temperature": params.temp, "top_p": params.top_p,
            "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "truncation": "disabled", "user": body.user,
            "metadata": body.metadata or {}, "service_tier": "default", "usage": None}


async def _continued(prep: Preparation, parent: StoredResponse, source: PromptSource, prompt: list[int]) -> list[int]:
    """The continuation's prompt: ``parent``'s tokens then the rest of the rendering, when the template renders the
    stored turn as the text they decode to; else ``prompt`` (the rendering tokenized whole)."""
    kv = parent.tokens
    if prompt[:len(kv)] == kv:
        return prompt
    tokenizer = prep.tokenizer

    def splice() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(source.messages, add_generation_prompt=True, tokenize=False,
                                                 **source.template_kwargs)
            head = tokenizer.decode(kv)
        except Exception:  # noqa: BLE001 - templates raise anything; the whole rendering stands
            return prompt
        if not isinstance(text, str) or not text.startswith(head) or len(text) == len(head):
            return prompt
        return kv + list(tokenizer.encode(text[len(head):], add_special_tokens=False))

    return await prep.lanes.on_worker(splice)


def _sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _events(handle: RequestHandle, output: ResponseOutput, keep: Any, store: ResponseStore, prompt_tokens: int,
                  keepalive_s: float | None) -> AsyncIterator[str]:
    """The response's server-sent events, one write per burst; the request is cancelled if the client
    disconnects (the generator is closed), and the response is then not stored."""
    finished = False
    try:
        yield "".join(map(_sse, output.opening()))
        async for burst in bursts(handle, idle_s=keepalive_s):
            if not burst:
                yield KEEPALIVE_EVENT
                continue
            parts: list[str] = []
            for e in burst:
                if e.kind == "token":
                    parts += map(_sse, output.feed(e))
                elif e.kind == "done":
                    usage = e.usage or Usage(prompt_tokens, len(output.tokens))
                    parts += map(_sse, output.closing(usage))
                    keep(usage)
                    finished = True
                else:
                    error = failure(e)
                    body = output.body("failed")
                    body["error"] = {"code": error.code or "server_error", "message": error.message}
                    parts.append(_sse(output.event("error", code=error.code, message=error.message, param=None)))
                    parts.append(_sse(output.event("response.failed", response=body)))
            if parts:
                yield "".join(parts)
    finally:
        if not finished:
            store.release(output.id)
        handle.cancel()  # a no-op once the request has finished
