"""The OpenAI-compatible HTTP app: routes over a running :class:`~mlxkv.engine.batch.BatchEngine`.

Handlers translate the OpenAI shape in and out; :mod:`mlxkv.server.preparation` tokenizes, validates and submits, as
for every route, and :func:`mlxkv.server.generation.failure` maps a failed request onto its HTTP error. Handlers
never touch MLX nor the engine's pool. Events come back into the handler's event loop
through the request handle. A client that disconnects (streaming or not) cancels its request, which the engine
drops at its next step, releasing the sequences.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator, Sequence, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import Event, GenerationRequest, RequestHandle, Usage
from mlxkv.config import SamplingDefaults
from mlxkv.server.anthropic import anthropic_router
from mlxkv.server.auth import bearer_auth
from mlxkv.server.cache_routes import cache_router
from mlxkv.server.choice_output import ChoiceOutput, Delta, LogprobFormat
from mlxkv.server.compat import DEFAULT_KEEPALIVE_S, KEEPALIVE_EVENT, system_fingerprint
from mlxkv.server.errors import APIError, error_body, install_error_handlers
from mlxkv.server.front_door import install_front_door
from mlxkv.server.generation import bursts, collect, failure
from mlxkv.server.image_parts import has_images, take_openai_images
from mlxkv.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    limit_messages,
    max_messages,
    template_cost,
    with_body,
)
from mlxkv.server.metrics import ServerMetrics
from mlxkv.server.prompts import PromptEncoder
from mlxkv.server.reasoning import splitter_for
from mlxkv.server.reasoning_effort import apply_reasoning_effort
from mlxkv.server.responses import ResponseBuilder, sse
from mlxkv.server.responses_api import StoreConfig, responses_router
from mlxkv.server.responses_api.routes import store_for
from mlxkv.server.sampling_args import max_new_tokens, sampling_params, template_kwargs
from mlxkv.server.schemas import ChatCompletionRequest, CompletionRequest
from mlxkv.server.structured_output import parse_format
from mlxkv.server.preparation import Constraint, Prepared, Preparation, PromptSource, tool_error
from mlxkv.server.tenancy import Tenants, check_max_client_priority, key_fingerprint, request_tenant
from mlxkv.server.token_text import TokenText
from mlxkv.server.tokenizing import TokenizerLanes
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.ui_routes import ui_router
from mlxkv.server.unicode_guard import reject_invalid_unicode
from mlxkv.server.tools import (
    ToolRequestError,
    check_template_renders_tools,
    render_tools,
    to_template_messages,
    tools_in_use,
)


def create_app(engine: BatchEngine, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics: ServerMetrics | None = None,
               ui: bool = True,
               manage_engine: bool = False, allowed_origins: Sequence[str] = (),
               keepalive_s: float = DEFAULT_KEEPALIVE_S, defaults: SamplingDefaults | None = None,
               max_client_priority: int = 100, admin_key: str | None = None,
               flush_timeout_s: float = 10.0, metrics_key: str | None = None, tenants: Tenants | None = None,
               public_metrics: bool = False, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               responses: StoreConfig | None = None, vision: Any = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the batch engine (its tokenizer encodes prompts).
        model_name: the id reported by ``/v1/models`` and in responses.
        api_key: require ``Authorization: Bearer <api_key>`` on /v1 routes (``None``: open; one tenant).
        max_body_bytes: larger request bodies get 413.
        metrics: the Prometheus registry fed by the engine (the engine's observer); a fresh one if ``None``.
        manage_engine: start the engine when the app starts and stop it when the app stops.
        ui: serve the built-in page at ``/`` (ui_routes.py).
        allowed_origins: CORS origins (``*``: any); none: no CORS headers.
        keepalive_s: a stream silent this long (a long prefill, a wait for admission) gets a keep-alive comment.
        defaults: the server's sampling defaults (``mlxkv serve --temp`` ...); a request's own values win.
        max_client_priority: the highest retention priority a request may ask for (above it: 400; tenancy.py).
        admin_key: the key a whole-cache ``/v1/cache/reset`` needs (``None``: anyone may; tenancy.py); also
            accepted wherever ``api_key`` is.
        flush_timeout_s: with ``manage_engine``, how long stopping may take to write the KV tier's cached blocks.
        metrics_key: a key (besides the API keys) that opens ``/metrics``, ``/docs``, ``/redoc`` and
            ``/openapi.json``; on a server with API keys or a metrics key, those routes need one of them.
        tenants: the API keys and their tenants (:class:`mlxkv.server.tenancy.Tenants`; instead of ``api_key``).
        public_metrics: ``/metrics`` stays open on a server with keys (the API description does not).
        body_timeout_s: a request body not whole this many seconds after the request's start gets 408.
        responses: how many ``/v1/responses`` results are stored and how their KV is retained (``None``: the
            defaults of :class:`~mlxkv.server.responses_api.StoreConfig`).
        vision: the model's image support (:class:`mlxkv.vision.inputs.VisionInputs`; ``None``: text only).
    """
    check_max_client_priority(max_client_priority)
    if metrics_key is not None and not metrics_key:
        raise ValueError("the metrics key must not be empty")
    if tenants is not None and api_key is not None:
        raise ValueError("give the API key as tenants or as api_key, not both")
    if tenants is None:
        tenants = Tenants({api_key: key_fingerprint(api_key)} if api_key else {}, admin_key)
    if public_metrics and metrics_key is not None:
        raise ValueError("--public-metrics and --metrics-key contradict each other: /metrics is open or needs a key")
    metrics = metrics or ServerMetrics()
    metrics.bind(engine.stats)
    engine.vision = vision
    defaults = defaults or SamplingDefaults()
    tokenizer = engine.tokenizer
    lanes = TokenizerLanes(tokenizer, engine.context_length)
    prompts = PromptEncoder(tokenizer, loop_tokenizer=lanes.loop_tokenizer)  # a long shared system prompt: once
    token_text = TokenText(tokenizer)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    vocab = min((v for v in (_vocab_size(tokenizer), engine.vocab_size) if v is not None), default=None)
    fingerprint = system_fingerprint(model_name, tokenizer, getattr(engine, "model", None))
    no_tools = check_template_renders_tools(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "mlxkv"}
    cost = template_cost(tokenizer)  # what the chat template adds per message: limits counted before rendering
    most = max_messages(engine.context_length, cost)
    ChatBody = limit_messages(ChatCompletionRequest, most, engine.context_length, cost)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await run_in_threadpool(engine.start)
        try:
            yield
        finally:
            if manage_engine:
                await run_in_threadpool(lambda: engine.stop(flush_timeout=flush_timeout_s))

    app = FastAPI(title="mlxkv", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible local inference over mlxkv's continuous-batching engine.")
    install_error_handlers(app)
    install_front_door(app, tenants=tenants, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                       metrics_key=metrics_key, public_metrics=public_metrics, allowed_origins=allowed_origins)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(tenants)),
                                               Depends(reject_invalid_unicode)])

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if ui:
        app.include_router(ui_router())

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise APIError(404, f"no model {model_id!r} here: this server serves {model_name!r}", "model_not_found",
                           "model")
        return card

    v1.include_router(cache_router(engine, keepalive_s=keepalive_s, admin_key=admin_key, multi_tenant=tenants.multi))

    # One preparation for every route (preparation.py): tokenizing on the loop or the worker lane, the grammar,
    # message ends and the overflow policy checked against the pool's facts; each route translates its shape only.
    prep = Preparation(engine, prompts, lanes, vocab, max_client_priority, cost, vision=vision)

    @v1.post("/chat/completions")
    @with_body(ChatBody)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", "no_chat_template")
        conflict = body.conflicting_max()
        if conflict:
            raise APIError(400, conflict, "invalid_value", "max_completion_tokens")
        fmt = parse_format(body.response_format)
        tools, tool_choice = body.tool_dicts(), body.tool_choice_value()
        try:
            use_tools = tools_in_use(tools, tool_choice)
            dumped = [m.model_dump(exclude_none=True) for m in body.messages]
            images = None
            if has_images(dumped, body.multi_modal_uuids):  # decoded off the event loop
                images = await prep.lanes.on_worker(lambda: take_openai_images(vision, dumped,
                                                                               body.multi_modal_uuids))
            messages = to_template_messages(dumped)
        except ToolRequestError as exc:
            raise tool_error(exc) from None
        if use_tools and no_tools:
            raise APIError(400, no_tools, "tools_unsupported", "tools")
        if no_tools and any(m.get("tool_calls") for m in messages):  # the template would drop them silently
            raise APIError(400, f"assistant tool_calls in the history: {no_tools}", "tools_unsupported", "messages")
        parallel = body.parallel_tool_calls is not False
        kwargs = template_kwargs(body, defaults)
        apply_reasoning_effort(tokenizer, body.reasoning_effort, kwargs, body.chat_template_kwargs)
        if use_tools:
            kwargs["tools"] = render_tools(tools)
        prepared = await prep.prepare(PromptSource(messages=messages, template_kwargs=kwargs, images=images),
                                      Constraint(fmt, tools if use_tools else None, tool_choice, parallel),
                                      body.kv_overflow, tenant=request_tenant(request), body=body)
        output = ToolOutput(tokenizer, tools, body.n, parallel=parallel, streaming=body.stream) if use_tools else None
        return await _generate(request, body, prepared, chat=True, tools=output)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        constraint = Constraint(parse_format(body.response_format))
        if isinstance(body.prompt, list) and isinstance(body.prompt[0], int):
            source = PromptSource(token_ids=list(body.prompt), param="prompt")
        else:
            source = PromptSource(text=body.prompt if isinstance(body.prompt, str) else body.prompt[0], param="prompt")
        prepared = await prep.prepare(source, constraint, body.kv_overflow, tenant=request_tenant(request),
                                      body=body)
        return await _generate(request, body, prepared, chat=False)

    async def _generate(request: Request, body: Union[ChatCompletionRequest, CompletionRequest], prepared: Prepared,
                        chat: bool, tools: ToolOutput | None = None) -> Any:
        prompt = prepared.prompt
        params = sampling_params(body, defaults, max_new_tokens(body, defaults, len(prompt), engine.context_length,
                                                                chat), vocab, engine.context_length)
        logprobs = body.logprobs_count()
        logprob_format = LogprobFormat(token_text, eos, chat) if logprobs is not None else None
        outputs = [ChoiceOutput(splitter_for(tokenizer, prompt) if chat else None, logprob_format, tools, i)
                   for i in range(body.n)]

        def build(p: Prepared) -> GenerationRequest:
            return p.request(params, n=body.n, logprobs=logprobs)

        handle = prep.submit(prepared, build)
        builder = ResponseBuilder(chat=chat, model=model_name, system_fingerprint=fingerprint,
                                  predicted=getattr(body, "prediction", None) is not None)
        if body.stream:
            return StreamingResponse(_stream(handle, builder, outputs, body.include_usage, keepalive_s),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, handle, builder, outputs)

    v1.include_router(anthropic_router(engine, prep, model_name=model_name, keepalive_s=keepalive_s,
                                       defaults=defaults, max_messages=most))
    app.state.responses_store = store_for(engine, responses)  # a multi-model server finds a response's model here
    v1.include_router(responses_router(engine, prep, model_name=model_name, store=app.state.responses_store,
                                       keepalive_s=keepalive_s, defaults=defaults))
    app.include_router(v1)
    return app


async def _collect(request: Request, handle: RequestHandle, builder: ResponseBuilder,
                   outputs: list[ChoiceOutput]) -> Any:
    """Wait for the whole response; cancel the request if the client goes away meanwhile."""
    events = await collect(request, handle)
    if events is None:
        return Response(status_code=499)  # nobody reads it
    if events[-1].kind != "done":
        raise failure(events[-1])
    for event in events[:-1]:
        outputs[event.index].feed(event.text, event.logprob, event.finish_reason)
    return builder.complete(outputs, events[-1].usage)


async def _stream(handle: RequestHandle, builder: ResponseBuilder, outputs: list[ChoiceOutput], include_usage: bool,
                  keepalive_s: float = DEFAULT_KEEPALIVE_S) -> AsyncIterator[str]:
    """Server-sent events, one write per burst of events; the request is cancelled if the client disconnects
    (the generator is closed). After ``keepalive_s`` seconds without an event (a long prefill, a wait for
    admission) a keep-alive comment goes out: proxies and clients drop silent connections."""
    try:
        if builder.chat:
            yield "".join(sse(builder.role_chunk(i)) for i in range(len(outputs)))
        async for burst in bursts(handle, idle_s=keepalive_s):
            if not burst:
                yield KEEPALIVE_EVENT
                continue
            parts: list[str] = []
            for event in burst:
                _render(event, builder, outputs, include_usage, parts)
            if parts:  # a token whose text the detokenizer holds back yet writes nothing
                yield "".join(parts)
    finally:
        handle.cancel()  # a no-op once the request has finished


def _render(event: Event, builder: ResponseBuilder, outputs: list[ChoiceOutput], include_usage: bool,
            out: list[str]) -> None:
    """Append ``event``'s server-sent events to ``out``."""
    if event.kind == "token":
        output = outputs[event.index]
        delta = output.feed(event.text, event.logprob, event.finish_reason)
        if delta:
            out.append(sse(builder.delta_chunk(event.index, delta)))
        if event.finish_reason:  # the choice's own reason: "tool_calls" after a call
            out.append(sse(builder.delta_chunk(event.index, Delta(), output.finish_reason)))
    elif event.kind == "done":
        if include_usage:
            out.append(sse(builder.usage_chunk(event.usage or Usage(0, 0))))
        out.append(sse("[DONE]"))
    else:
        error = failure(event)
        out.append(sse(error_body(error.status, error.message, error.code)))


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else len(tokenizer)
    except TypeError:
        return None

