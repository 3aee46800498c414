"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request's conversation is rendered through the model's chat template as ``/v1/chat/completions`` renders the
same conversation (the same :class:`~mlxkv.server.prompts.PromptEncoder`, so a long shared system prompt is
tokenized once and its KV comes from the prefix cache alike) and submitted through the same engine path
(:mod:`mlxkv.server.generation`). Tools go through the chat route's tool calling (:mod:`mlxkv.server.anthropic.
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
from mlxkv.server.anthropic.translate import Conversation, to_conversation
from mlxkv.server.errors import APIError
from mlxkv.server.generation import collect, submit
from mlxkv.server.kv_overflow import request_overflow
from mlxkv.server.message_ends import message_ends
from mlxkv.server.prompts import PromptEncoder
from mlxkv.server.structured_output import needs_grammar, output_format, parse_format
from mlxkv.server.tokenizing import TokenizerLanes, content_chars
from mlxkv.server.tools import ToolRequestError, check_template_renders_tools
from mlxkv.structured import ResponseFormat


def anthropic_router(engine: BatchEngine, prompts: PromptEncoder, lanes: TokenizerLanes, *, model_name: str,
                     keepalive_s: float | None = None, defaults: SamplingDefaults | None = None) -> APIRouter:
    """The Messages routes over ``engine`` (mount under ``/v1``, behind the API-key check).

    Args:
        engine: the batch engine.
        prompts: the app's prompt encoder (shared with the OpenAI chat route).
        lanes: the app's tokenizing lanes (short prompts on the event loop, others on a worker thread).
        model_name: the model id reported in responses.
        keepalive_s: a stream silent this long gets a ``ping`` event (``None``: none).
        defaults: the server's sampling defaults and chat-template variables (``mlxkv serve --temp`` ...), for
            what a request leaves unset, as on the OpenAI routes.
    """
    defaults = defaults or SamplingDefaults()
    kwargs = dict(defaults.chat_template_kwargs)
    tokenizer = engine.tokenizer
    has_template = bool(getattr(tokenizer, "chat_template", None))
    no_tools = check_template_renders_tools(tokenizer) if has_template else None
    router = APIRouter(tags=["anthropic"])
    free_text = parse_format(None)  # the Messages API has no response_format: only tool choices constrain

    def continue_final(messages: list[dict[str, Any]], template: dict[str, Any]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                  continue_final_message=True, **template))

    async def grammar(conv: Conversation, plan: ToolPlan) -> ResponseFormat | None:
        """The grammar a forced ``tool_choice`` (``any``, ``tool``) or ``strict`` tools impose, as on the chat
        route (built on the tokenizer thread: it encodes the call markers and may build the grammar vocabulary)."""
        if not needs_grammar(free_text, plan.tools, conv.tool_choice):
            return None
        try:
            return await lanes.on_worker(lambda: output_format(tokenizer, free_text, plan.tools, conv.tool_choice,
                                                               parallel=plan.parallel))
        except ToolRequestError as exc:
            raise anthropic_tool_error(exc, conv) from None

    async def render(body: CountTokensRequest) -> tuple[list[int], ToolPlan, Conversation]:
        conv: Conversation = to_conversation(body)
        if not has_template:
            raise APIError(400, "this model's tokenizer has no chat template", "no_chat_template")
        plan = plan_tools(conv, no_tools)
        messages, template = plan.messages, {**kwargs, **plan.template_kwargs}
        problem = lanes.check_chars(content_chars(messages))
        if problem is not None:
            raise APIError(400, problem, "context_length_exceeded", "messages")
        try:
            if conv.prefill:  # rendered whole: the memo's head/tail split assumes a generation prompt
                ids = await lanes.on_worker(lambda: continue_final(messages, template))
            else:
                ids = await lanes.tokenize(lambda: prompts.chat_if_cheap(messages, **template),
                                           lambda: prompts.chat(messages, **template))
        except Exception as exc:  # noqa: BLE001 - templates raise anything (jinja errors, bad roles)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "invalid_messages") from None
        return ids, plan, conv

    @router.post("/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API: one answer (text and tool_use blocks), whole or streamed."""
        prompt, plan, conv = await render(body)
        fmt = await grammar(conv, plan)
        template = {**kwargs, **plan.template_kwargs}
        ends = (await lanes.on_worker(lambda: message_ends(tokenizer, plan.messages, prompt, template))
                if engine.state_snapshots and len(plan.messages) > 1 else ())  # recurrent hybrids: snapshot there
        stops = tuple(body.stop_sequences or ())
        overflow = request_overflow(body.kv_overflow, engine.pool)

        def build() -> GenerationRequest:
            params = SamplingParams(max_tokens=body.max_tokens,
                                    temp=defaults.temp if body.temperature is None else body.temperature,
                                    top_p=defaults.top_p if body.top_p is None else body.top_p,
                                    top_k=defaults.top_k if body.top_k is None else body.top_k,
                                    min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty,
                                    stop=stops)
            return GenerationRequest(prompt, params, response_format=fmt, snapshot_at=ends, kv_overflow=overflow)

        handle = submit(engine, build, prompt_param="messages")
        reply = Reply(tokenizer, model=model_name, max_tokens=body.max_tokens, stop_sequences=stops,
                      prompt_tokens=len(prompt), tools=plan.output(tokenizer))
        if body.stream:
            return StreamingResponse(message_events(handle, reply, keepalive_s), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        events = await collect(request, handle)
        if events is None:
            return Response(status_code=499)  # the client is gone; nobody reads it
        if events[-1].kind != "done":
            raise APIError(500, f"generation failed: {events[-1].message}", "generation_failed")
        for event in events[:-1]:
            reply.add(event)
        return reply.message(events[-1].usage)

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The rendered prompt's length in tokens (tools included)."""
        return {"input_tokens": len((await render(body))[0])}

    return router
