"""The OpenAI-compatible HTTP API over a ``Worker`` (FastAPI): ``/v1/completions`` and ``/v1/chat/completions``,
streamed by server-sent events or not, ``/v1/models`` and ``/health``.

A bad request gets a 400 with OpenAI's error body and touches nothing else; a client that goes away mid-stream has
its request cancelled, its pages freed before the next step. Text streams as it becomes final: a token that ends
inside a UTF-8 character, or text that may still turn out to begin a stop string, is held back until it settles.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvjax import validate
from kvjax.runtime.scheduler import Request
from kvjax.runtime.text import chat_ids, cut_at_stop, encode_prompt, eos_ids, stopped
from kvjax.serving.worker import Worker

# A text of n characters is refused untokenized when n > TEXT_MARGIN x longest token x positions: each token spans
# at most ``longest_token`` characters of the text, and the margin covers normalizations that shrink it
TEXT_MARGIN = 2


def longest_token(tokenizer) -> int:
    """The most characters any one token of ``tokenizer`` stands for (its vocabulary's longest piece; a byte-level
    piece has a character per byte, more than the text it decodes to), or 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if p is not None), default=1)


class BadRequest(Exception):
    """A request the server refuses with a 400 and this message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    # vLLM's extensions, for benchmarks: generate past EOS; and stream every token with its id, text or not
    ignore_eos: bool = False
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, gt=0)


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as one line, and the field it is about."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    where = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    field = ".".join(where) or None
    return (f"{field}: {e.get('msg', 'invalid')}" if field else str(e.get("msg", "invalid request"))), field


class _Stream:
    """Tokens of one request, from the engine thread into the event loop, and the text they make so far."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stops: list[str]):
        self.loop, self.tokenizer, self.stops = loop, tokenizer, stops
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tokens: list[int] = []
        self.sent_text = ""

    def sink(self, request: Request, new: list[int], finished: bool) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (list(new), finished))

    def text(self, final: bool) -> str:
        """New text that is settled: cut before a stop string; while running, short of a partial character or of
        a tail that might begin a stop string."""
        whole = self.tokenizer.decode(self.tokens, skip_special_tokens=True) if self.tokenizer else ""
        text = cut_at_stop(whole, self.stops)
        if len(text) == len(whole) and not final:
            text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[: len(text) - hold] if hold else text
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text += delta
        return delta


class Server:
    """The API's state and handlers: ``model`` served under ``name`` through ``worker``."""

    def __init__(self, worker: Worker, model, name: str):
        self.worker, self.model, self.name = worker, model, name
        engine = worker.engine  # positions per sequence (prompt + new tokens): what the cache holds of max_seq_len
        self.capacity = min(engine.max_seq_len, engine.cache_tokens)
        self.accepting = True
        self.stop_ids = eos_ids(model)
        # Tokenizing runs beside the event loop, two prompts at a time, so a long prompt stalls no other client; a
        # text too long to fit whatever its tokens is refused before any of it is tokenized (``longest_token``).
        self.tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvjax-tokenize")
        self.longest_token = longest_token(model.tokenizer)
        self.max_chars = TEXT_MARGIN * self.longest_token * self.capacity

    async def admit(self, prompt, messages: list[dict] | None = None) -> list[int]:
        """``encode`` off the event loop, after refusing at once a text no tokenization could fit in the cache."""
        if messages is None:
            chars = len(prompt) if isinstance(prompt, str) else 0
        else:
            chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_chars:
            raise BadRequest(
                f"the {'prompt holds' if messages is None else 'messages hold'} {chars:,} characters; no token of this "
                f"model spans more than {self.longest_token}, so they need more than "
                f"the {self.capacity} positions this server's cache holds per sequence (refused before tokenizing)",
                "prompt" if messages is None else "messages",
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizing, functools.partial(self.encode, prompt, messages))

    def encode(self, prompt, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a completion prompt (text or ids) or of chat ``messages`` through the chat template."""
        tok = self.model.tokenizer
        try:
            if messages is None:
                return encode_prompt(self.model, prompt, chat=False)
            if tok is None or not getattr(tok, "chat_template", None):
                raise BadRequest("this model has no chat template: use /v1/completions", "messages")
            return encode_prompt(self.model, chat_ids(tok, messages), chat=False)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e).splitlines()[0], "prompt" if messages is None else "messages") from None

    def start(self, body: _Sampling, ids: list[int], max_tokens: int) -> tuple[Request, _Stream]:
        """Check ``body`` against this server and queue its request."""
        if not self.accepting:
            raise BadRequest("the server is shutting down")
        if body.model != self.name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {self.name!r}", "model")
        if len(ids) + max_tokens > self.capacity:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; with max_tokens={max_tokens} it needs {len(ids) + max_tokens} "
                f"positions, more than the {self.capacity} this server's cache holds per sequence",
                "max_tokens",
            )
        try:
            _, stops = validate.stops(body.stop)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e), "stop") from None
        if stops and self.model.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer, and this model has none", "stop")
        stop_ids = set() if body.ignore_eos else self.stop_ids
        stopper = functools.partial(stopped, self.model, stop_ids=stop_ids, stop_texts=stops)
        seed = body.seed if body.seed is not None else uuid.uuid4().int >> 65
        request = Request(ids, max_tokens, body.temperature, body.top_p, seed, 0, stopper)
        stream = _Stream(asyncio.get_running_loop(), self.model.tokenizer, stops)
        self.worker.submit(request, stream.sink)
        return request, stream

    async def respond(self, request: Request, stream: _Stream, body: _Sampling, chunk, final) -> Any:
        """``request``'s output, whole (``final``) or streamed as events (``chunk``); a client gone cancels it."""
        created, rid = int(time.time()), uuid.uuid4().hex
        if body.stream:
            if body.return_token_ids:
                chunk = functools.partial(_with_ids, chunk)
            events = self._events(request, stream, chunk, rid, created, body.return_token_ids)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            while True:
                new, finished = await stream.queue.get()
                stream.tokens += new
                if finished:
                    break
        finally:
            self.worker.cancel(request)  # no-op once finished; frees the pages of a client that left
        if request.finish_reason == "error":
            return _error(500, request.error or "generation failed", kind="server_error")
        stream.text(final=True)
        out = final(rid, created, stream.sent_text, _reason(request), _usage(request))
        if body.return_token_ids:
            out["choices"][0]["token_ids"] = list(request.tokens)
        return out

    async def _events(self, request: Request, stream: _Stream, chunk, rid: str, created: int, every: bool):
        """Server-sent events: a chunk per settled text delta (``every``: per token batch, with their ids)."""
        try:
            first = chunk(rid, created, None, None)
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            while True:
                new, finished = await stream.queue.get()
                stream.tokens += new
                delta = stream.text(final=finished)
                if delta or (every and new):
                    event = chunk(rid, created, delta, None, ids=new) if every else chunk(rid, created, delta, None)
                    yield f"data: {json.dumps(event)}\n\n"
                if finished:
                    last = chunk(rid, created, "", _reason(request), _usage(request))
                    yield f"data: {json.dumps(last)}\n\n"
                    # why it failed, as OpenAI streams an error: an event of its own
                    if request.finish_reason == "error":
                        error = {"message": request.error, "type": "server_error", "param": None, "code": None}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            self.worker.cancel(request)

    async def drain(self, grace_s: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Shut down (SIGTERM, Ctrl-C; ``graceful_server``): refuse new requests, let those in flight finish for up
        to ``grace_s`` seconds (less once ``forced()`` turns true: a second Ctrl-C), then abort the rest and end the
        engine thread (``Worker.stop``). The event loop keeps running meanwhile, so each aborted request's finish
        reaches its response: a stream ends with its "abort" chunk and [DONE]; and the engine thread is gone, the
        device idle, before the loop closes."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.worker.in_flight and loop.time() < deadline and not forced():
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.worker.stop)  # off the loop: the sinks' last calls come back through it


def _with_ids(chunk, rid, created, text, reason, usage=None, ids=None):
    """``chunk``'s event with the ids of the tokens it carries (``return_token_ids``)."""
    event = chunk(rid, created, text, reason, usage)
    if event is not None:
        event["choices"][0]["token_ids"] = list(ids or [])
    return event


def _usage(request: Request) -> dict:
    prompt, new = len(request.prompt), len(request.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def _event(obj: str, prefix: str, name: str, rid: str, created: int, choice: dict, usage=None) -> dict:
    out = {"id": f"{prefix}-{rid}", "object": obj, "created": created, "model": name, "choices": [choice]}
    return {**out, "usage": usage} if usage else out


def _completion_chunk(name: str, rid: str, created: int, text: str | None, reason, usage=None):
    if text is None:  # completions have no opening event
        return None
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return _event("text_completion", "cmpl", name, rid, created, choice, usage)


def _chat_chunk(name: str, rid: str, created: int, text: str | None, reason, usage=None):
    delta: dict = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return _event("chat.completion.chunk", "chatcmpl", name, rid, created, choice, usage)


def _chat_final(name: str, rid: str, created: int, text: str, reason, usage):
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
    return _event("chat.completion", "chatcmpl", name, rid, created, choice, usage)


def create_app(worker: Worker, model, name: str) -> FastAPI:
    """The API serving ``model`` (under ``name``) through ``worker``; ``app.state.server`` holds its state."""
    app = FastAPI(title="kvjax", version="1")
    server = app.state.server = Server(worker, model, name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(BadRequest)
    async def _bad(request: HttpRequest, exc: BadRequest):
        return _error(400, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HttpRequest, exc: StarletteHTTPException):  # 404, 405, ...: OpenAI's error body
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = what.get(exc.status_code, str(exc.detail))
        return _error(exc.status_code, message, kind=kind, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        ok = server.accepting and worker.error is None
        return {"status": "ok" if ok else "stopping", **worker.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvjax"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        request, stream = server.start(body, await server.admit(body.prompt), body.max_tokens or 16)
        chunk = functools.partial(_completion_chunk, name)
        return await server.respond(request, stream, body, chunk, chunk)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        ids = await server.admit(None, [m.model_dump() for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, server.capacity - len(ids))
        request, stream = server.start(body, ids, max_tokens)
        chunk, final = functools.partial(_chat_chunk, name), functools.partial(_chat_final, name)
        return await server.respond(request, stream, body, chunk, final)

    return app


# Clients pool idle connections for 5 s (httpx's default, which the openai client keeps); uvicorn's default keep-alive
# is also 5 s, so a request sent on a pooled socket as the server closes it fails without reaching the server
# (a ConnectionError in the client, seen in CI). The server keeps idle connections longer than clients do.
KEEP_ALIVE_S = 75


def server_config(app: FastAPI, host: str, port: int, *, keep_alive: int = KEEP_ALIVE_S, **kwargs):
    """uvicorn's config for ``app``: idle connections are kept ``keep_alive`` seconds, longer than clients' pools
    keep them, so a client never reuses a connection the server is closing."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=keep_alive, **kwargs)


# After the grace and the aborts, how long responses may take to reach their clients before uvicorn cuts them
FLUSH_S = 10


def graceful_server(config, server: Server, grace_s: float):
    """uvicorn's server for ``config``, whose app is ``server``'s, shutting down (SIGTERM, Ctrl-C) in this order:
    stop accepting connections (idle ones close), let requests in flight finish for ``grace_s`` seconds, abort the
    rest and stop the engine (``Server.drain``), then uvicorn's own shutdown: the responses flush, for
    ``config.timeout_graceful_shutdown`` seconds at most (``FLUSH_S`` is a fit), and the loop closes.

    uvicorn's shutdown alone waits ``timeout_graceful_shutdown`` for the responses, then cancels them mid-stream (no
    abort chunk, no [DONE]), and the engine, stopped only once the loop had closed, went on calling into it."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for listener in getattr(self, "servers", ()):
                listener.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()  # an idle one closes now, a busy one once its response is sent
            await server.drain(grace_s, lambda: self.force_exit)
            # a second Ctrl-C (force_exit) has cut the grace short; the rest is bounded, and skipping it would drop
            # the streams' last chunks and the app's shutdown (a traceback): a third one still cuts the flush short
            self.force_exit = False
            await super().shutdown(sockets)

    return GracefulServer(config)


def _reason(request: Request) -> str:
    """OpenAI's finish reason: "stop" (EOS or a stop string), "length", or "abort" when the server cut it short."""
    return request.finish_reason if request.finish_reason in ("stop", "length") else "abort"
