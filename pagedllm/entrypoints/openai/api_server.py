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
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import Admission, APIError, OpenAIServing
from .shutdown import Drain, DrainingServer, DrainMiddleware, route_path

logger = logging.getLogger("pagedllm.server")

# Probes work without the key (unless --health-require-api-key), and so does the
# dashboard's page (a static file; its data follows the metrics' rule).
HEALTH_PATHS = frozenset({"/health", "/version"})
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


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's complaint as a 400 naming the field, without its internals (no input
    echo, no docs links, no error-type codes)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request", 400)
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {err.get('msg')}", 400)
    full = list(err.get("loc", ()))
    skip = 1 if full[:1] == ["body"] else 0
    loc = full[skip:]
    cut = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    if cut is not None:  # no branch of a union matched: say what each branch wanted
        loc, prefix = loc[:cut], full[: skip + cut]
        msgs = dict.fromkeys(e.get("msg", "") for e in errors
                             if list(e.get("loc", ()))[: len(prefix)] == prefix)
        msg = "invalid value (" + "; ".join(list(msgs)[:3]) + ")"
    else:
        msg = str(err.get("msg"))
    if not loc:
        return APIError(f"the request body is invalid: {msg}", 400)
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return APIError(f"{path}: {msg}", 400, str(loc[0]))


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Awaitable[BaseModel | AsyncIterator[str]],
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
              sampling_defaults: dict | None = None) -> FastAPI:
    """The FastAPI app over a running engine. `chat_template` is the template text;
    `options` the tool and reasoning parsers of chat answers; `monitoring` the stats line,
    request logging and vLLM metric names; `sampling_defaults` the default sampling
    settings (None: read as config.generation_config says). While the app runs, a
    background task samples the engine once a second for /dashboard, and another writes
    the stats line.
    `app.state.drain` is the drain the server starts on SIGTERM."""
    limits = limits or ServerLimits()
    monitoring = monitoring or MonitoringOptions()
    sampler = engine_sampler(engine, config.model_name)
    app = FastAPI(title="pagedllm", version=__version__,
                  lifespan=lambda _app: _background(sampler, engine, monitoring))
    admission = Admission(limits.max_waiting_requests)
    if sampling_defaults is None:
        sampling_defaults = default_sampling_overrides(config.generation_config, config.model)
    base = OpenAIServing(engine, config, chat_template, admission)
    completions = OpenAIServingCompletion(engine, config, chat_template, admission,
                                          limits.max_response_logprobs,
                                          sampling_defaults=sampling_defaults)
    chat = OpenAIServingChat(engine, config, chat_template, admission, limits.max_response_logprobs,
                             sampling_defaults=sampling_defaults, options=options)
    for serving in (completions, chat):
        serving.log_requests = monitoring.log_requests
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
    app.add_middleware(DrainMiddleware, drain=drain, open_paths=METRICS_PATHS)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    add_metrics_routes(app, engine, sampler, vllm_names=monitoring.vllm_metric_names)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        log_rejection(request.method, request.url.path, exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        log_rejection(request.method, request.url.path, err)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), exc.status_code, code=getattr(exc, "code", None))
        log_rejection(request.method, request.url.path, err)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not engine.is_healthy:
            err = APIError("the engine has stopped", 503)
            log_rejection(request.method, request.url.path, err)
            return JSONResponse(err.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    # Probes and monitors may ask with HEAD (RFC 9110: what answers GET answers HEAD); a
    # route of its own, outside the schema, so that no operation id is listed twice.
    for path, endpoint in (("/health", health), ("/version", version)):
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=config.model, max_model_len=base.max_model_len)
                               for name in base.served_names])

    @app.get("/v1/engine/stats")
    async def stats() -> dict:
        """Scheduler and KV-cache numbers as JSON, e.g. to watch blocks return to the pool."""
        return {**msgspec.structs.asdict(engine.stats()), "healthy": engine.is_healthy}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, completions.create(body), limits.request_timeout)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, chat.create(body), limits.request_timeout)

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
    return "\n".join([
        f"pagedllm {__version__}: serving {', '.join(names)}",
        f"  model        {d.get('model')}",
        f"  device       {d.get('device')}, dtype {d.get('dtype')}, "
        f"weights {d.get('weights_GiB')} GiB",
        f"  KV cache     {d.get('kv_blocks')} blocks x {d.get('block_size')} tokens = "
        f"{d.get('kv_tokens')} tokens ({d.get('kv_GiB')} GiB); "
        f"{d.get('max_len_seqs_that_fit')} sequences of max_model_len {d.get('max_model_len')} fit",
        f"  batching     max_num_batched_tokens {d.get('max_num_batched_tokens')} per step, "
        f"max_num_seqs {d.get('max_num_seqs')}, prefix caching "
        f"{'on' if d.get('prefix_caching') else 'off'}",
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
        app = build_app(engine, config, api_key=api_key, chat_template=chat_template,
                        metrics_require_api_key=args.metrics_require_api_key,
                        health_require_api_key=args.health_require_api_key, limits=limits,
                        allowed_origins=args.allowed_origins, options=options,
                        monitoring=monitoring, sampling_defaults=sampling_defaults)
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
