"""Bounds that keep one client from hurting the others: the size of a request body, and
the time a request may take (`cli_args.ServerLimits` holds the settings; the cap on
waiting requests is `serving_engine.Admission`, the drain on shutdown `shutdown.py`).

Both answer in OpenAI's error shape: 413 for a body over the limit, and 504 (code
`request_timeout`) for a request that ran past `--request-timeout`: it is aborted in the
engine, which frees its blocks. A stream that has begun cannot change its status, so its
last event is the same error object, then `[DONE]`. 504 rather than 408: 408 says the
client was too slow to send its request, while here the server gave up waiting on the
engine, as a gateway gives up on an upstream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .monitoring import log_rejection
from .serving_engine import SSE_DONE, APIError, sse

logger = logging.getLogger(__name__)


class BodyTooLarge(HTTPException):
    """Raised from `receive` while the body arrives; FastAPI lets HTTP exceptions through
    its body parsing, so the client gets this 413 rather than a parse error."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of "
                              f"{limit} bytes (--max-request-body-bytes)")
        self.code = "request_too_large"


async def refuse(scope: Scope, receive: Receive, send: Send, err: APIError,
                 close: bool = True) -> None:
    """Answer, from a middleware, a request it stops: the error logged, in OpenAI's shape,
    with its headers; `close` ends the connection (a client whose request was not read to
    its end, or who should retry elsewhere, starts afresh)."""
    log_rejection(scope.get("method", ""), scope["path"], err)
    headers = dict(err.headers or {})
    if close:
        headers["Connection"] = "close"
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class HeaderLimitMiddleware:
    """431 for a request whose headers (names and values together) pass `max_bytes`. The
    HTTP parser takes headers of any size, so without this a client could send megabytes
    of them on every request and get a 200; browsers and proxies keep theirs to a few
    kilobytes."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.max_bytes:
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.max_bytes:
                await refuse(scope, receive, send, APIError(
                    f"the request headers are {size} bytes, more than this server's limit of "
                    f"{self.max_bytes} (--max-header-bytes)", 431, code="headers_too_large"))
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, otherwise
    (chunked uploads) as soon as the bytes received pass the limit. Plain ASGI, so
    streaming responses and disconnects pass through untouched.

    A body announced too large but of at most DRAIN_BYTES is read and dropped before the
    answer: a client that sends its whole body before reading (most do) otherwise finds
    the connection reset by the close, with unread bytes in the socket, and never sees
    the 413. Reading costs the server only the bytes; nothing is parsed."""

    DRAIN_BYTES = 64 * 2**20

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= self.DRAIN_BYTES:
                while (await receive()).get("more_body", False):
                    pass
            err = BodyTooLarge(self.max_bytes)
            await refuse(scope, receive, send, APIError(err.detail, 413, code=err.code))
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


def timeout_error(timeout: float) -> APIError:
    return APIError(f"the request did not finish within the server's request timeout of "
                    f"{timeout:g} s (--request-timeout) and was aborted", 504,
                    code="request_timeout")


async def with_deadline(events: AsyncIterator[str], deadline: float, timeout: float
                        ) -> AsyncIterator[str]:
    """The server-sent events of a stream until `deadline` (event-loop time); then the
    stream is closed (aborting its engine requests) and ends with a timeout error."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(events), deadline - loop.time())
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                logger.warning("a streamed request ran past --request-timeout %g s: aborted",
                               timeout)
                yield sse(timeout_error(timeout).body())
                yield SSE_DONE
                return
            yield event
    finally:
        await events.aclose()
