"""The OpenAI-compatible HTTP server: routes, errors in OpenAI's shape, API keys, startup.

    python -m pagedllm.entrypoints.openai.api_server --port 8080 --max-context-length 4096

Every failure a client can cause is answered with OpenAI's error object and touches no
other request: validation happens before a request reaches the engine, and the engine
rejects what only it can check (a ValueError) before the response starts. Error bodies
never carry a traceback, a file path or an unexpected exception's text (those go to the
log). The protective limits (queue cap, request timeout, body size, drain on shutdown) are
`limits.ServerLimits`; CORS is off unless `--allowed-origins` names origins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.generation_config import default_sampling_overrides, describe_overrides
from pagedllm.log_format import configure_logging

from .cli_args import (
    ChatOptions,
    ServerLimits,
    chat_options,
    engine_config,
    ignored_vllm_flags,
    load_chat_template,
    lora_modules,
    make_arg_parser,
    monitoring_options,
    parse_args,
    resolve_api_key,
    root_path,
    server_limits,
    ssl_files,
)
from .limits import (
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
    refuse,
    timeout_error,
    with_deadline,
)
from .metrics_routes import (
    DASHBOARD_PATH,
    METRICS_PATHS,
    add_metrics_routes,
    engine_sampler,
    sampling,
)
from .monitoring import MonitoringOptions, StatsLogger, log_rejection
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from .responses_store import ResponseStore
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_embedding import OpenAIServingEmbedding
from .serving_engine import Admission, APIError, OpenAIServing, model_root
from .serving_models import ServedAdapters
from .serving_responses import OpenAIServingResponses, ResponsesRequest
from .shutdown import Drain, DrainingServer, DrainMiddleware, route_path

logger = logging.getLogger("pagedllm.server")

# Probes work without the key (unless --health-require-api-key), and so does the
# dashboard's page (a static file; its data follows the metrics' rule). /health is the
# liveness probe, /ready the readiness probe: they differ only while draining.
LIVENESS_PATH, READINESS_PATH = "/health", "/ready"
HEALTH_PATHS = frozenset({LIVENESS_PATH, READINESS_PATH, "/version"})
OPEN_PATHS = HEALTH_PATHS | {DASHBOARD_PATH}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class APIKeyMiddleware:
    """Rejects requests without `Authorization: Bearer <key>` before any body is read.
    Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.expected = _digest(api_key)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and route_path(scope) not in self.open_paths:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # Constant time, so the key cannot be guessed byte by byte from response times;
            # digests of equal length, so not even its length shows.
            ok = hmac.compare_digest(_digest(token.strip()), self.expected)
            if scheme.lower() != "bearer" or not ok:
                await refuse(scope, receive, send, APIError(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), close=False)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes a client's `X-Request-Id` on its response (every one: errors, refusals and
    streams too), so that a client or a proxy can match answers to its own logs, as vLLM
    does with --enable-request-id-headers. Only echoed, never made the engine's request id:
    two clients may send the same one. A request without one gets none."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = None
        if scope["type"] == "http":
            request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if request_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-request-id", request_id)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class InternalErrorMiddleware:
    """An unexpected exception becomes a 500 in OpenAI's shape naming its type alone; the
    traceback goes to the log. Caught here, inside Starlette's outermost layer (which would
    answer too, but then re-raise and make the server drop the client's connection)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # a response has begun: only closing the connection is left
                raise
            logger.exception("request failed")
            await refuse(scope, receive, send, APIError(
                f"internal server error ({type(e).__name__}); see the server log", 500),
                close=False)


# Pydantic's names for the branches of a union ('str', 'list[int]'), which mean nothing
# to a client: a path is cut where one starts.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}
# Pydantic's words for a body that is not an object ('... or instance of ChatCompletionRequest'
# names a class).
_NOT_AN_OBJECT = {"model_type", "model_attributes_type", "dict_type"}
# What pydantic puts before a validator's own message ('Value error, top_k must be ...').
_VALIDATOR_PREFIXES = ("Value error, ", "Assertion failed, ")


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def _plain(msg: object) -> str:
    text = str(msg)
    for prefix in _VALIDATOR_PREFIXES:
        text = text.removeprefix(prefix)
    return text


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's complaint as a 400 naming the field, without its internals (no input
    echo, no docs links, no error-type codes, no class names)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request", 400)
    err = errors[0]
    full = list(err.get("loc", ()))
    if err.get("type") == "json_invalid":  # loc: ('body', offset); ctx: json's reason
        why = (err.get("ctx") or {}).get("error") or "it cannot be parsed"
        at = f" at character {full[1]}" if len(full) > 1 and isinstance(full[1], int) else ""
        return APIError(f"the request body is not valid JSON: {why}{at}", 400)
    skip = 1 if full[:1] == ["body"] else 0
    loc = full[skip:]
    if not loc and err.get("type") == "missing":
        return APIError("the request body is empty: send a JSON object", 400)
    if not loc and err.get("type") in _NOT_AN_OBJECT:
        return APIError("the request body must be a JSON object", 400)
    cut = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    if cut is not None:  # no branch of a union matched: say what each branch wanted
        loc, prefix = loc[:cut], full[: skip + cut]
        msgs = dict.fromkeys(_plain(e.get("msg", "")) for e in errors
                             if list(e.get("loc", ()))[: len(prefix)] == prefix)
        msg = "invalid value (" + "; ".join(list(msgs)[:3]) + ")"
    else:
        msg = _plain(err.get("msg"))
    if not loc:  # a check of the whole body; a FieldError names its field
        param = getattr((err.get("ctx") or {}).get("error"), "param", None)
        return APIError(f"the request body is invalid: {msg}", 400, param)
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if not msg.startswith(path + " "):  # 'chat_template_kwargs nests deeper ...' names it
        msg = f"{path}: {msg}"
    return APIError(msg, 400, str(loc[0]))


def _is_json(content_type: str | None) -> bool:
    """What FastAPI parses as JSON: application/json or application/*+json."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def content_type_error(content_type: str | None) -> APIError | None:
    """A body not sent as JSON, named by its header. FastAPI then hands the raw bytes to
    pydantic, whose complaint ('Input should be a valid dictionary') does not say why;
    curl's `-d` sends `application/x-www-form-urlencoded`, a common cause. 400, not 415:
    OpenAI answers a body it cannot read with 400 `invalid_request_error` (and vLLM with
    400), so the openai client raises BadRequestError, as for any other malformed body."""
    if _is_json(content_type):
        return None
    got = (f"this request's is {content_type[:100]!r}" if content_type
           else "this request has none")
    return APIError("the request body must be JSON, sent with the header 'Content-Type: "
                    f"application/json' ({got})", 400)


# FastAPI's 400 when the body cannot even be decoded (json raised something other than a
# JSONDecodeError); the cause says what went wrong.
_UNREADABLE_BODY = "There was an error parsing the body"


def http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """An HTTP error raised by the framework, in words that say what to change: the method
    and path of a 404 or 405 (as OpenAI's 'Invalid URL (GET /v1/x)'), and why a body could
    not be read."""
    detail, status = str(exc.detail), exc.status_code
    where = f"{request.method} {request.url.path[:200]}"
    if status == 404 and detail == "Not Found":
        detail = f"Invalid URL ({where}): this server has no such route"
    elif status == 405 and detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("Allow", "")
        detail = f"Invalid method for URL ({where}): this route takes {allowed}"
    elif status == 400 and detail == _UNREADABLE_BODY:
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            detail = "the request body is not valid JSON: it is not UTF-8 text"
        elif isinstance(cause, RecursionError):
            detail = "the request body is not valid JSON this server can read: it nests too deeply"
        else:
            detail = "the request body could not be read as JSON"
    return APIError(detail, status, code=getattr(exc, "code", None), headers=exc.headers)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Awaitable[BaseModel | dict | AsyncIterator[str]],
                   timeout: float | None = None) -> Response:
    """Run `work` until it answers, the client goes away or `timeout` seconds pass. A
    request that is not streamed is cancelled (and so aborted in the engine) when its client
    disconnects or its time is up; a streamed one is cancelled by the streaming response
    itself, or by its deadline."""
    timeout = timeout or None  # 0: no limit
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not done:
        logger.warning("a request ran past --request-timeout %g s: aborted", timeout)
        raise timeout_error(timeout)
    if task.cancelled():
        return Response(status_code=499)  # client closed the request; nobody reads this
    result = task.result()
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    if isinstance(result, dict):  # plain data (embeddings, responses): msgspec writes it
        return Response(msgspec.json.encode(result), media_type="application/json")
    if deadline is not None:
        result = with_deadline(result, deadline, timeout)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(engine: AsyncLLM, config: EngineConfig, api_key: str | None = None,
              chat_template: str | None = None, metrics_require_api_key: bool = False,
              health_require_api_key: bool = False, limits: ServerLimits | None = None,
              allowed_origins: list[str] | None = None,
              options: ChatOptions | None = None,
              monitoring: MonitoringOptions | None = None,
              sampling_defaults: dict | None = None,
              lora_modules: list[tuple[str, str]] | None = None,
              allow_runtime_lora_updating: bool = False,
              responses_store: ResponseStore | None = None) -> FastAPI:
    """The FastAPI app over a running engine. `chat_template` is the template text;
    `options` the tool and reasoning parsers of chat answers; `monitoring` the stats line,
    request logging and vLLM metric names; `sampling_defaults` the default sampling
    settings (None: read as config.generation_config says); `responses_store` keeps the
    Responses API's stored responses (None: one of the default bounds). While the app runs, a
    background task samples the engine once a second for /dashboard, and another writes
    the stats line. `lora_modules`: (name, path) of the LoRA adapters served from the start
    (ValueError for one the engine cannot run); `allow_runtime_lora_updating` adds the
    routes that load and unload adapters while serving.
    `app.state.drain` is the drain the server starts on SIGTERM."""
    limits = limits or ServerLimits()
    monitoring = monitoring or MonitoringOptions()
    sampler = engine_sampler(engine, config.model_name)
    app = FastAPI(title="pagedllm", version=__version__,
                  lifespan=lambda _app: _background(sampler, engine, monitoring))
    admission = Admission(limits.max_waiting_requests)
    if sampling_defaults is None:
        sampling_defaults = default_sampling_overrides(config.generation_config, config.model)
    adapters = ServedAdapters(lambda lora: engine.processor.check_lora(lora))
    base = OpenAIServing(engine, config, chat_template, admission, adapters=adapters)
    for name, path in lora_modules or []:
        adapters.load(name, path, base.aliases)
    completions = OpenAIServingCompletion(engine, config, chat_template, admission,
                                          limits.max_response_logprobs,
                                          sampling_defaults=sampling_defaults, adapters=adapters)
    chat = OpenAIServingChat(engine, config, chat_template, admission, limits.max_response_logprobs,
                             sampling_defaults=sampling_defaults, options=options,
                             adapters=adapters)
    for serving in (completions, chat):
        serving.log_requests = monitoring.log_requests
    embeddings = OpenAIServingEmbedding(engine, config, admission=admission)
    responses = OpenAIServingResponses(
        chat, ResponseStore() if responses_store is None else responses_store)
    app.state.responses_store = responses.store
    pooling_only = config.runner == "pooling"

    def generation_route() -> None:
        if pooling_only:
            raise APIError("this server runs its model for embeddings only (--runner "
                           "pooling): use /v1/embeddings", 400, code="model_not_supported")
    app.state.admission = admission
    app.state.drain = drain = Drain(limits.shutdown_timeout)
    # Added innermost first: CORS (answering preflights, which carry no key) runs first,
    # then the drain, the body limit, the key check, and the net for unexpected errors.
    app.add_middleware(InternalErrorMiddleware)
    if api_key:
        open_paths = OPEN_PATHS - (HEALTH_PATHS if health_require_api_key else set())
        if not metrics_require_api_key:
            open_paths |= METRICS_PATHS
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=limits.max_header_bytes)
    # While draining, liveness and the metrics stay open; readiness (like the API) says 503.
    app.add_middleware(DrainMiddleware, drain=drain,
                       open_paths=METRICS_PATHS | {LIVENESS_PATH})
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
    add_metrics_routes(app, engine, sampler, vllm_names=monitoring.vllm_metric_names)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        log_rejection(request.method, request.url.path, exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Every body this server takes is JSON: one sent as anything else is named as such.
        err = content_type_error(request.headers.get("content-type")) or validation_error(exc)
        log_rejection(request.method, request.url.path, err)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = http_error(request, exc)
        log_rejection(request.method, request.url.path, err)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def probe(request: Request) -> Response:
        if not engine.is_healthy:
            err = APIError("the engine has stopped", 503, code="engine_unavailable")
            log_rejection(request.method, request.url.path, err)
            return JSONResponse(err.body(), status_code=503)
        return Response(status_code=200)

    @app.get(LIVENESS_PATH)
    async def health(request: Request) -> Response:
        """Liveness: 200 while the engine runs, draining included (restarting a process
        that is finishing its requests would cut them); 503 once it has stopped."""
        return probe(request)

    @app.get(READINESS_PATH)
    async def ready(request: Request) -> Response:
        """Readiness: as /health, but 503 from the start of a drain (the DrainMiddleware
        answers it), so that load balancers stop sending before the server stops."""
        return probe(request)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    # Probes and monitors may ask with HEAD (RFC 9110: what answers GET answers HEAD); a
    # route of its own, outside the schema, so that no operation id is listed twice.
    for path, endpoint in ((LIVENESS_PATH, health), (READINESS_PATH, ready),
                           ("/version", version)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)

    @app.get("/v1/models")
    async def models() -> ModelList:
        root = model_root(config)
        cards = [ModelCard(id=name, root=root, max_model_len=base.max_model_len)
                 for name in base.served_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_name, parent=base.model_name,
                            max_model_len=base.max_model_len) for lora in adapters.all()]
        return ModelList(data=cards)

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            try:
                await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path,
                                        base.aliases)
            except ValueError as e:
                raise APIError(str(e), 400, "lora_path" if "adapter" in str(e) else "lora_name") from None
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                            media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            if adapters.unload(body.lora_name) is None:
                raise APIError(f"The LoRA adapter `{body.lora_name}` is not loaded.", 404,
                               "lora_name", "model_not_found")
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                            media_type="text/plain")

    @app.get("/v1/engine/stats")
    async def stats() -> dict:
        """Scheduler and KV-cache numbers as JSON, e.g. to watch blocks return to the pool."""
        return {**msgspec.structs.asdict(engine.stats()), "healthy": engine.is_healthy}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        generation_route()
        return await _respond(request, completions.create(body), limits.request_timeout)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        generation_route()
        return await _respond(request, chat.create(body), limits.request_timeout)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        generation_route()
        return await _respond(request, responses.create(body), limits.request_timeout)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        return await responses.cancel(response_id)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await _respond(request, embeddings.create(body), limits.request_timeout)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        base.check_request(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            _, tokens = base.render_chat(body.messages, body.add_generation_prompt)
        else:
            tokens = base.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=base.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        base.check_request(body)
        vocab = len(base.require_tokenizer())
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(f"tokens must be integers in [0, {vocab})", 400, "tokens")
        return DetokenizeResponse(prompt=base.decode(body.tokens))

    return app


@contextlib.asynccontextmanager
async def _background(sampler, engine: AsyncLLM, monitoring: MonitoringOptions
                      ) -> AsyncIterator[None]:
    """The app's lifespan: the dashboard's sampler, and the stats line unless it is off.
    Both are tasks on the server's event loop, never work in the engine's step loop."""
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(sampling(sampler))
        # (Stand-in engines of HTTP-layer tests keep no metrics: nothing to report.)
        if monitoring.stats_interval and getattr(engine, "metrics", None) is not None:
            stats = StatsLogger(engine, monitoring.stats_interval)
            task = asyncio.create_task(stats.run(), name="pagedllm-stats-logger")
            stack.callback(task.cancel)
        yield


def startup_banner(engine: AsyncLLM, config: EngineConfig, names: list[str], host: str,
                   port: int, api_key: bool, metrics_key: bool = False, scheme: str = "http",
                   prefix: str = "") -> str:
    """What an operator tunes by: the model, the KV pool and the token budget."""
    d = engine.describe()
    shown_host = "localhost" if host in ("0.0.0.0", "::", "") else host
    base = f"{scheme}://{shown_host}:{port}{prefix}"
    lora = [f"  LoRA         {d['lora']}"] if d.get("lora", "off") != "off" else []
    return "\n".join([
        f"pagedllm {__version__}: serving {', '.join(names)}",
        f"  model        {d.get('model')}",
        f"  device       {d.get('device')}, dtype {d.get('dtype')}, "
        f"weights {d.get('weights_GiB')} GiB",
        f"  KV cache     {d.get('kv_blocks')} blocks x {d.get('block_size')} tokens = "
        f"{d.get('kv_tokens')} tokens ({d.get('kv_GiB')} GiB); {d.get('kv_pool')}",
        f"  batching     max_num_batched_tokens {d.get('max_num_batched_tokens')} per step "
        f"(prompt tokens at most {d.get('max_prefill_tokens_with_decodes') or 'all of them'} "
        f"while sequences decode), max_num_seqs {d.get('max_num_seqs')}, prefix caching "
        f"{'on' if d.get('prefix_caching') else 'off'}",
        *lora,
        f"  API          {base}/v1 (listening on {host}:{port}"
        f"{', API key required' if api_key else ''})",
        f"  monitoring   {base}/metrics (Prometheus), {base}/dashboard"
        f"{' (API key required)' if api_key and metrics_key else ''}",
    ])


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a busy or forbidden port is
    reported in a second, not after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"pagedllm: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(args: argparse.Namespace) -> None:
    """Bind the port, load the model, print what was built, and serve until SIGTERM or
    Ctrl-C, which drain running requests for up to --shutdown-timeout seconds before the
    exit (0)."""
    # One format for pagedllm, uvicorn (given the same config below) and the core process.
    log_config = configure_logging(args.log_level)
    ignored = ignored_vllm_flags(args)
    if ignored:
        logger.warning("accepted for vLLM compatibility, no effect here: %s", ", ".join(ignored))
    try:
        config = engine_config(args)
        limits = server_limits(args)
        chat_template = load_chat_template(args.chat_template)
        options = chat_options(args)
        monitoring = monitoring_options(args)
        ssl_keyfile, ssl_certfile = ssl_files(args)
        prefix = root_path(args)
        loras = lora_modules(args)
        # Read before the model loads: a wrong --generation-config folder fails at once.
        sampling_defaults = default_sampling_overrides(config.generation_config, config.model)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"pagedllm: cannot start: {e}") from None
    sock = listen_socket(args.host, args.port)
    try:
        engine = AsyncLLM(config)  # the engine core starts in a process of its own
    except (ValueError, OSError, RuntimeError) as e:
        logger.debug("startup failed", exc_info=True)
        raise SystemExit(f"pagedllm: cannot start: {e}") from None
    try:
        api_key = resolve_api_key(args)
        try:
            app = build_app(engine, config, api_key=api_key, chat_template=chat_template,
                            metrics_require_api_key=args.metrics_require_api_key,
                            health_require_api_key=args.health_require_api_key, limits=limits,
                            allowed_origins=args.allowed_origins, options=options,
                            monitoring=monitoring, sampling_defaults=sampling_defaults,
                            lora_modules=loras,
                            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                            responses_store=ResponseStore(args.responses_store_max))
        except ValueError as e:  # a --lora-modules adapter the engine cannot run
            raise SystemExit(f"pagedllm: cannot start: {e}") from None
        names = OpenAIServing(engine, config).served_names
        print(startup_banner(engine, config, names, args.host, args.port, bool(api_key),
                             args.metrics_require_api_key,
                             "https" if ssl_certfile else "http", prefix), flush=True)
        logger.info("%s", describe_overrides(sampling_defaults, config.generation_config))
        # After the drain, handlers ended at its deadline need a moment to send their error.
        server_config = uvicorn.Config(app, host=args.host, port=args.port,
                                       log_level=args.log_level, log_config=log_config,
                                       timeout_graceful_shutdown=5, root_path=prefix,
                                       ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
        server = DrainingServer(server_config, app.state.drain, on_deadline=engine.stop)
        engine.add_dead_callback(server.engine_died)
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if server.engine_died_at is not None:
        raise SystemExit("pagedllm: the engine stopped; see the log above")


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser(argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="OpenAI-compatible server for pagedllm"))
    run_server(parse_args(parser, argv))


if __name__ == "__main__":
    main()
