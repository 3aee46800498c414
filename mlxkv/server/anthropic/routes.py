"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request's conversation is rendered through the model's chat template as ``/v1/chat/completions`` renders the
same conversation, through the same request preparation (:mod:`mlxkv.server.preparation`: one prompt memo, so a
long shared system prompt is tokenized once and its KV comes from the prefix cache alike; one grammar, message-end
and overflow path) and the same engine outcomes (:mod:`mlxkv.server.generation`: a graceful stop is a 503 here
too). Tools go through the chat route's tool calling (:mod:`mlxkv.server.anthropic.
tool_use`), so ``count_tokens`` counts them as rendered. Errors on these paths take Anthropic's shape
(:mod:`mlxkv.server.errors`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from mlxkv.config import SamplingDefaults
from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.sampling import SamplingParams
from mlxkv.server.anthropic.message import Reply
from mlxkv.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlxkv.server.anthropic.stream import message_events
from mlxkv.server.anthropic.tool_use import ToolPlan, anthropic_tool_error, plan_tools
from mlxkv.server.anthropic.translate import Conversation, response_format, to_conversation
from mlxkv.server.errors import APIError
from mlxkv.server.generation import collect, failure
from mlxkv.server.limits import limit_messages, with_body
from mlxkv.server.preparation import Constraint, Prepared, Preparation, PromptSource
from mlxkv.server.structured_output import parse_format
from mlxkv.server.tenancy import request_tenant
from mlxkv.server.tools import check_template_renders_tools

def anthropic_router(engine: BatchEngine, prep: Preparation, *, model_name: str,
                     keepalive_s: float | None = None, defaults: SamplingDefaults | None = None,
                     max_messages: int | None = None) -> APIRouter:
    """The Messages routes over ``engine`` (mount under ``/v1``, behind the API-key check).

    Args:
        engine: the batch engine.
        prep: the app's request preparation (shared with the OpenAI routes: tokenizing lanes, prompt memo,
            grammars, message ends, overflow policy).
        model_name: the model id reported in responses.
        keepalive_s: a stream silent this long gets a ``ping`` event (``None``: none).
        defaults: the server's sampling defaults and chat-template variables (``mlxkv serve --temp`` ...), for
            what a request leaves unset, as on the OpenAI routes.
        max_messages: the most messages a request may have (:func:`mlxkv.server.limits.limit_messages`).
    """
    defaults = defaults or SamplingDefaults()
    kwargs = dict(defaults.chat_template_kwargs)
    tokenizer = engine.tokenizer
    has_template = bool(getattr(tokenizer, "chat_template", None))
    no_tools = check_template_renders_tools(tokenizer) if has_template else None
    router = APIRouter(tags=["anthropic"])
    cost = prep.cost
    MessagesBody = limit_messages(MessagesRequest, max_messages, engine.context_length, cost)
    CountBody = limit_messages(CountTokensRequest, max_messages, engine.context_length, cost)

    async def translate(body: CountTokensRequest) -> tuple[PromptSource, ToolPlan, Conversation]:
        """The request's prompt in chat form and its tool use (400 for what cannot be honoured); its images
        decoded off the event loop."""
        images = None
        if body.multi_modal_uuids is not None or any(getattr(b, "type", None) == "image" for m in body.messages
                                                     for b in (m.content if isinstance(m.content, list) else ())):
            images = await prep.lanes.on_worker(lambda: take_anthropic_images(prep.vision, body))
        conv: Conversation = to_conversation(body)
        if not has_template:
            raise APIError(400, "this model's tokenizer has no chat template", "no_chat_template")
        plan = plan_tools(conv, no_tools)
        source = PromptSource(messages=plan.messages, template_kwargs={**kwargs, **plan.template_kwargs},
                              continue_final=conv.prefill, images=images)
        return source, plan, conv

    @router.post("/messages")
    @with_body(MessagesBody)
    async def create_message(body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API: one answer (text and tool_use blocks), whole or streamed."""
        source, plan, conv = await translate(body)
        fmt_body, fmt_field = response_format(body)
        try:
            fmt = parse_format(fmt_body)
        except APIError as exc:  # named as this request sent it
            raise APIError(exc.status, f"{fmt_field}: {exc.message}", exc.code, fmt_field) from None
        constraint = Constraint(fmt=fmt, tools=plan.tools, tool_choice=conv.tool_choice, parallel=plan.parallel,
                                tool_error=lambda exc: anthropic_tool_error(exc, conv, fmt_field))
        prepared = await prep.prepare(source, constraint, body.kv_overflow, tenant=request_tenant(request), body=body)
        stops = tuple(body.stop_sequences or ())

        def build(p: Prepared) -> GenerationRequest:
            params = SamplingParams(max_tokens=body.max_tokens,
                                    temp=defaults.temp if body.temperature is None else body.temperature,
                                    top_p=defaults.top_p if body.top_p is None else body.top_p,
                                    top_k=defaults.top_k if body.top_k is None else body.top_k,
                                    min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty,
                                    stop=stops)
            return p.request(params)

        handle = prep.submit(prepared, build)
        reply = Reply(tokenizer, model=model_name, max_tokens=body.max_tokens, stop_sequences=stops,
                      prompt_tokens=len(prepared.prompt), tools=plan.output(tokenizer))
        if body.stream:
            return StreamingResponse(message_events(handle, reply, keepalive_s), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        events = await collect(request, handle)
        if events is None:
            return Response(status_code=499)  # the client is gone; nobody reads it
        if events[-1].kind != "done":
            raise failure(events[-1])
        for event in events[:-1]:
            reply.add(event)
        return reply.message(events[-1].usage)

    @router.post("/messages/count_tokens")
    @with_body(CountBody)
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The rendered prompt's length in tokens (tools and each image's placeholder tokens included)."""
        source = (await translate(body))[0]
        prompt = await prep.tokens(source)
        if source.images:
            prompt, _ = await prep.images(source, prompt)
        return {"input_tokens": len(prompt)}

    return router


def take_anthropic_images(vision: Any, body: CountTokensRequest) -> Any:
    """The ``image`` blocks of ``body``'s messages, decoded (each left as its marker text); a text-only model keeps
    them (:func:`~mlxkv.server.anthropic.translate.to_conversation` refuses them).

    Raises:
        APIError: 400 for a bad image or UUID list, or a vision model whose mlx-vlm is missing.
    """
    uuids = (body.multi_modal_uuids or {}).get("image")
    from mlxkv.server.anthropic.schemas import TextBlock
    from mlxkv.vision.images import ImageError
    from mlxkv.vision.inputs import VisionInputs
    from mlxkv.vision.support import VisionUnavailable

    try:
        return (vision or VisionInputs()).take_anthropic(body.messages, uuids,
                                                         lambda text: TextBlock(type="text", text=text))
    except (ImageError, VisionUnavailable) as exc:
        raise APIError(400, str(exc), "invalid_image", "messages") from None
