"""`python -m a3b_core serve MODEL`: one loaded model behind an OpenAI-compatible HTTP server (aiohttp).

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health. Requests are OpenAI chat completions: text and
`image_url` parts (images as data URLs), `stream` as server-sent events, the reasoning in `reasoning_content` as vLLM
and SGLang return it, `chat_template_kwargs.enable_thinking` (without it, the model's own default: off for the demo
models, on for Qwen3.5/3.6 releases as their template says), max_tokens or max_completion_tokens, temperature, top_p,
top_k, min_p, presence_penalty, repetition_penalty, seed, stop, usage.
Sampler values a request leaves out take Qwen's recommendation for its thinking mode, as in A3BModel.generate.

A request is prepared before it is queued (openai_requests.py), on one of PREPARE_THREADS threads, so that one
request's preparation never holds up other clients' answers. Decoded images wait for the worker within MAX_HELD_PIXELS
for all requests together (a request that would pass it waits before decoding).

The engine is not thread-safe, so one worker thread owns the model: it runs the vision tower on queued requests'
images and decodes the requests that can share one sampler as one batch (same thinking mode, sampler values,
max_tokens and stop strings); the others wait for a later batch. A sampled request with its own seed runs alone, so a
seed gives the same answer however busy the server is. The event loop reads requests and streams the text out. A
client that disconnects cancels its request: a waiting request is dropped, and a batch stops within one token once
every client of it is gone (the engine stops a batch as a whole, so a batch that still has other clients finishes,
without sending the gone client's text anywhere).

A server without an API key (it listens on this machine only) answers only requests addressed to this machine (a
loopback Host), and refuses any request that a web page of another origin sends (its Origin header), unless that
origin was allowed with --allow-origin; every POST must be `Content-Type: application/json`, which a web page cannot
send to another origin without the server's consent.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from PIL import Image

from .. import A3BError, A3BModel, ChatPrompt, ConfigError, GenerationResult, load_model, split_reasoning
from ..runtime.adapters import LoraRequest
from ..runtime.options import LoadOptions
from .openai_requests import ChatRequest, RequestError, RequestPreparer

log = logging.getLogger("a3b.serve")

MAX_BODY_BYTES = 32 * 2**20  # a request with several large PNG images fits; anything bigger is refused (413)
MAX_HELD_PIXELS = 2**29  # decoded images all requests hold at once (native size, ~1.5 GiB as RGB); more waits
PREPARE_THREADS = 2  # requests prepared (parsed, checked, images decoded, prompt built) at once, beside the worker
IDLE_TIMEOUT_S = 15  # a connection without a whole request header this long after opening or its last answer is closed
BODY_TIMEOUT_S = 120  # seconds a request body may take to arrive once its header has
THINK_TAGS = ("<think>", "</think>")
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop"}


# ------------------------------------------------------------------------------------------------ streaming
class AnswerStream:
    """The engine's growing output as OpenAI deltas: `reasoning_content` and `content` pieces that add up to the
    final reasoning and answer.

    Only text that later tokens cannot change is sent: nothing from a stop string on (the answer ends before it),
    and no trailing piece that may still become a stop string or a think tag. The output only grows, so each update
    searches only where a tag or stop string may have begun since the last one: the work an update does for them
    does not grow with the answer."""

    def __init__(self, thinking: bool, stops: tuple[str, ...]):
        self.thinking = thinking
        self.stops = stops
        self.sent = {"reasoning_content": "", "content": ""}
        self._answer_from: int | None = None if thinking else 0  # where stop strings count: after the think block
        self._searched = {"think": 0, "stop": 0}  # no think close, no stop string starts before these
        self._stop_at: int | None = None
        self._held_from = 0  # no tail of the text from before here can still become a tag or stop string

    def update(self, live_text: str) -> dict[str, str]:
        """`live_text`: the whole output so far as on_text gives it (in thinking mode it opens with <think>)."""
        return self._delta(*split_reasoning(self._settled(live_text), thinking=False))

    def finish(self, result: GenerationResult) -> dict[str, str]:
        return self._delta(result.reasoning, result.text)

    def _delta(self, reasoning: str, answer: str) -> dict[str, str]:
        delta = {}
        for name, text in (("reasoning_content", reasoning), ("content", answer)):
            sent = self.sent[name]
            if len(text) > len(sent) and text.startswith(sent):
                delta[name] = text[len(sent):]
                self.sent[name] = text
        return delta

    def _settled(self, text: str) -> str:
        if self._answer_from is None:
            close = self._find(text, (THINK_TAGS[1],), "think", 0)
            if close is not None:
                self._answer_from, self._held_from = close + len(THINK_TAGS[1]), 0  # stop strings are held from now
        held = THINK_TAGS
        if self._answer_from is not None:
            if self._stop_at is None:
                self._stop_at = self._find(text, self.stops, "stop", self._answer_from)
            if self._stop_at is not None:
                return text[:self._stop_at]
            held += self.stops
        longest = max(map(len, held))
        keep = max(self._held_from, len(text) - longest + 1)
        while keep < len(text) and not any(len(word) > len(text) - keep and word.startswith(text[keep:])
                                           for word in held):
            keep += 1
        self._held_from = keep
        return text[:keep]

    def _find(self, text: str, words: tuple[str, ...], kind: str, start: int) -> int | None:
        """Where the first of `words` starts in `text` from `start`, searching only what the last search of `kind`
        could not have seen whole."""
        if not words:
            return None
        begin = max(start, self._searched[kind])
        hits = [hit for hit in (text.find(word, begin) for word in words) if hit != -1]
        self._searched[kind] = max(begin, len(text) - max(map(len, words)) + 1)
        return min(hits) if hits else None


# ------------------------------------------------------------------------------------------------ the worker
@dataclass(eq=False)
class Job:
    """One prepared request on its way through the worker. The worker reports to the request's handler through
    `events`: ("text", whole text so far), then ("done", GenerationResult) or ("error", A3BError)."""
    request: ChatRequest
    images: list[Image.Image]  # decoded at the size the vision tower takes; dropped once it has run
    prompt: ChatPrompt  # built with stand_ins for the images, which the worker replaces with their embeddings
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    key: tuple = field(init=False)

    def __post_init__(self):
        self.key = self.request.batch_key()

    def send(self, kind: str, value: object) -> None:
        """From the worker thread to the handler."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """The one thread that uses the model: batches of compatible jobs (one served name each), in arrival order of
    their first job; each batch runs with its served name's LoRA adapters on the model."""

    def __init__(self, model: A3BModel, max_batch_size: int, served: dict[str, LoraRequest]):
        self.model = model
        self.served = served
        self.max_batch_size = max_batch_size
        self.running = 0
        self.largest_batch = 0
        self._pending: list[Job] = []
        self._ready = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="a3b-serve-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting for a batch (a cancelled one is dropped when the worker next looks)."""
        with self._ready:
            return sum(1 for job in self._pending if not job.cancelled.is_set())

    def submit(self, job: Job) -> None:
        with self._ready:
            self._pending.append(job)
            self._ready.notify()

    def close(self) -> None:
        """Stops the running batch within one token and ends the thread."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join()

    def _next_batch(self) -> list[Job] | None:
        with self._ready:
            while True:
                self._pending = [job for job in self._pending if not job.cancelled.is_set()]
                if self._closing:
                    return None
                if self._pending:
                    break
                self._ready.wait()
            key = self._pending[0].key
            batch = [job for job in self._pending if job.key == key][:self.max_batch_size]
            self._pending = [job for job in self._pending if job not in batch]
            self.running = len(batch)
            return batch

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            except Exception as exc:  # an engine bug: the server goes on serving, the clients learn of it
                log.exception("generation failed")
                for job in batch:
                    job.send("error", RequestError(f"the server failed while generating ({type(exc).__name__}); check "
                                                   "its log.", status=500, kind="server_error"))
            finally:
                self.running = 0

    def _run(self, batch: list[Job]) -> None:
        self.model.set_loras(self.served[batch[0].request.model])  # checked at start: nothing to read or refuse
        ready = []
        for job in batch:
            try:
                self._encode(job)
                ready.append(job)
            except A3BError as exc:
                job.send("error", exc)
        if not ready:
            return
        self.largest_batch = max(self.largest_batch, len(ready))
        request = ready[0].request
        seed = request.seed if request.seed is not None else secrets.randbits(63) if request.sampled else 0
        try:
            results = self.model.generate_batch(
                [job.prompt for job in ready], max_new_tokens=min(job.max_new_tokens for job in ready), seed=seed,
                stop=request.stop, on_text=lambda index, text: ready[index].send("text", text),
                should_stop=lambda: self._closing or all(job.cancelled.is_set() for job in ready),
                **request.sampling)
        except A3BError as exc:  # the settings all these requests share
            for job in ready:
                job.send("error", exc)
            return
        for job, result in zip(ready, results):
            log.info("%d prompt + %d new tokens, %s, batch of %d%s", len(job.prompt.input_ids),
                     len(result.token_ids), result.stop_reason, len(ready),
                     " (client gone)" if job.cancelled.is_set() else "")
            job.send("done", result)

    def _encode(self, job: Job) -> None:
        """The vision tower on the job's images; their embeddings take the stand-ins' place in its prompt."""
        if not job.images:
            return
        encoded = self.model.encode_images(job.images, resize="native", srgb=False)  # already sRGB, at that size
        job.images = []
        job.prompt = ChatPrompt(job.prompt.prompt, encoded)  # generation checks that their token counts agree


# ------------------------------------------------------------------------------------------------ HTTP
def error_body(exc: A3BError) -> tuple[int, dict]:
    if isinstance(exc, RequestError):
        status, kind, param, code = exc.status, exc.kind, exc.param, exc.code
    else:  # the engine refusing a prompt, an image or a sampler value
        status, kind, param, code = 400, "invalid_request_error", None, None
    return status, {"error": {"message": str(exc), "type": kind, "param": param, "code": code}}


def error_response(exc: A3BError) -> web.Response:
    status, body = error_body(exc)
    return web.json_response(body, status=status)


class PixelBudget:
    """Decoded image pixels that all requests hold at once, at most `limit`: a request waits for room before it decodes
    its images, and gives its share back when it ends. Used from the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._waiting: set[asyncio.Future] = set()

    @contextlib.asynccontextmanager
    async def holding(self, pixels: int) -> AsyncIterator[None]:
        while self.held + pixels > self.limit:
            room = asyncio.get_running_loop().create_future()
            self._waiting.add(room)
            try:
                await room
            finally:
                self._waiting.discard(room)
        self.held += pixels
        try:
            yield
        finally:
            self.held -= pixels
            for room in self._waiting:
                if not room.done():
                    room.set_result(None)


class ChatServer:
    """The aiohttp application around one model, its worker and the threads that prepare requests."""

    def __init__(self, model: A3BModel, model_name: str, api_key: str | None, max_batch_size: int,
                 allowed_origins: tuple[str, ...] = (), named_loras: dict[str, LoraRequest] | None = None):
        """`model_name` serves the model with the adapters it was loaded with; each of `named_loras` serves it with
        those and its own (vLLM's --lora-modules)."""
        self.model = model
        self.model_name = model_name
        self.api_key = api_key
        self.allowed_origins = allowed_origins
        base = model.loras
        self.served = {model_name: base} | {name: [*base, *loras] for name, loras in (named_loras or {}).items()}
        for loras in self.served.values():  # every adapter read and checked before the first request
            model.set_loras(loras)
        model.set_loras(base)
        self.requests = RequestPreparer(model, tuple(self.served))
        self.worker = Worker(model, max_batch_size, self.served)
        self.preparer = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="a3b-serve-prepare")
        self.budget = PixelBudget(MAX_HELD_PIXELS)
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.on_response_prepare.append(self._allow_origin)
        self.app.on_cleanup.append(lambda _app: asyncio.to_thread(self.close))

    def close(self) -> None:
        self.preparer.shutdown(cancel_futures=True)
        self.worker.close()

    # -------------------------------------------------------------------------------------------- who may ask
    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Who may ask (Origin, Host, API key, Content-Type), and every error as an OpenAI error object."""
        try:
            refusal = self._refusal(request)
            if refusal is not None:
                return error_response(refusal)
            if request.method == "OPTIONS":  # a browser asking whether an allowed origin may send its request
                return web.Response(status=204, headers={"Access-Control-Allow-Methods": "GET, POST",
                                                         "Access-Control-Allow-Headers": "Authorization, Content-Type",
                                                         "Access-Control-Max-Age": "600"})
            return await handler(request)
        except A3BError as exc:
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(RequestError(f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB. Use "
                                               "fewer or smaller images (PNG or JPEG, resized first).", status=413))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(RequestError(f"{request.method} {request.path}: {exc.reason}. Use POST "
                                               "/v1/chat/completions, GET /v1/models or GET /health.",
                                               status=exc.status))
        except Exception as exc:  # a bug: the client still gets an error object, the log the traceback
            log.exception("%s %s failed", request.method, request.path)
            return error_response(RequestError(f"the server failed ({type(exc).__name__}); check its log.",
                                               status=500, kind="server_error"))

    def _refusal(self, request: web.Request) -> RequestError | None:
        """Why the server will not answer `request`, or None."""
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.allowed_origins and origin != f"http://{request.host}":
            return RequestError(f"requests from the web page origin {origin!r} are refused, so that no web page can "
                                f"drive this server. To allow that origin, pass --allow-origin {origin} when starting "
                                "the server.", status=403, code="origin_not_allowed")
        if self.api_key is None and not is_loopback(host_name(request.host)):
            return RequestError(f"the request is addressed to {request.host!r}, not to this machine: a server without "
                                "an API key answers only requests to localhost or a loopback address. Use "
                                "http://127.0.0.1:<port>/v1.", status=403, code="host_not_allowed")
        if request.method == "OPTIONS":
            return None if origin in self.allowed_origins else RequestError(
                f"OPTIONS {request.path}: only web pages of origins allowed with --allow-origin may ask this server "
                "for permission; pass --allow-origin ORIGIN when starting the server to allow one.", status=403,
                code="origin_not_allowed")
        if self.api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return RequestError("missing or wrong API key: set the header 'Authorization: Bearer <key>' with the "
                                    "key the server was started with.", status=401, code="invalid_api_key")
        if request.method == "POST" and request.content_type != "application/json":
            return RequestError(f"the request body is sent as {request.content_type!r}; send JSON, and set the header "
                                "'Content-Type: application/json'.", status=415)
        return None

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Lets the web page of an allowed origin read the answer."""
        origin = request.headers.get("Origin")
        if origin in self.allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    # -------------------------------------------------------------------------------------------- endpoints
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, "running": self.worker.running,
                                  "waiting": self.worker.waiting, "largest_batch": self.worker.largest_batch,
                                  "held_pixels": self.budget.held})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "a3b-nodes",
            "max_model_len": self.model.max_context} for name in self.served]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {BODY_TIMEOUT_S} s of its header; check the "
                               "connection, or use fewer or smaller images.", status=408) from None
        loop = asyncio.get_running_loop()
        chat, pixels = await loop.run_in_executor(self.preparer, self.requests.checked, raw)
        async with self.budget.holding(pixels):
            images, prompt, max_new_tokens = await loop.run_in_executor(self.preparer, self.requests.prepared, chat)
            job = Job(chat, images, prompt, max_new_tokens, loop)
            self.worker.submit(job)
            try:
                return await self._answer(request, job)
            finally:
                job.cancelled.set()  # a client gone before the end (the handler is cancelled) stops its generation

    async def _answer(self, request: web.Request, job: Job) -> web.StreamResponse:
        completion_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        kind, value = await _next_event(job)
        if kind == "error":
            return error_response(value)
        if not job.request.stream:
            while kind == "text":
                kind, value = await _next_event(job)
            if kind == "error":
                return error_response(value)
            result: GenerationResult = value
            message = {"role": "assistant", "content": result.text, "reasoning_content": result.reasoning or None}
            return web.json_response({
                "id": completion_id, "object": "chat.completion", "created": created, "model": job.request.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": FINISH_REASONS[result.stop_reason]}],
                "usage": _usage(result)})

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            await response.write(f"data: {json.dumps(data) if isinstance(data, dict) else data}\n\n".encode())

        def chunk(delta: dict, finish_reason: str | None = None) -> dict:
            return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": job.request.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

        stream = AnswerStream(job.request.thinking, job.request.stop)
        try:
            await send(chunk({"role": "assistant", "content": ""}))
            while kind == "text":
                delta = stream.update(value)
                if delta:
                    await send(chunk(delta))
                kind, value = await _next_event(job)
            if kind == "error":
                await send(error_body(value)[1])
            else:
                delta = stream.finish(value)
                if delta:
                    await send(chunk(delta))
                await send(chunk({}, FINISH_REASONS[value.stop_reason]))
                if job.request.include_usage:
                    await send({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                "model": job.request.model, "choices": [], "usage": _usage(value)})
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left; the handler's caller cancels the job
        return response


async def _next_event(job: Job) -> tuple[str, object]:
    """The job's next event; of texts waiting together, only the newest (each holds the whole text so far)."""
    kind, value = await job.events.get()
    while kind == "text" and not job.events.empty():
        kind, value = job.events.get_nowait()
    return kind, value


def _usage(result: GenerationResult) -> dict:
    prompt, completion = result.stats["prompt_tokens"], len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------------------------------------ command line
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name or address in a Host header (host, host:port, [IPv6]:port), without its port."""
    name = host.rpartition("]")[0][1:] if host.startswith("[") else host.partition(":")[0]
    return name.lower()


def api_key_from_env(variable: str | None, host: str) -> str | None:
    """The key clients must send, read from the environment variable named `variable`. A server reachable from
    other machines (any host but a loopback address) refuses to start without one."""
    if variable is not None:
        key = os.environ.get(variable, "")
        if not key.strip():
            raise ConfigError(f"--api-key-env {variable}: the environment variable {variable} is not set or empty. "
                              f"Set it to the key clients must send (for example `export {variable}=$(openssl rand "
                              "-hex 24)`), or leave out --api-key-env.")
        return key.strip()
    if not is_loopback(host):
        raise ConfigError(f"--host {host} makes the server reachable from other machines, so it needs an API key: put "
                          "a key in an environment variable and pass its name with --api-key-env VAR (clients send it "
                          "as 'Authorization: Bearer <key>'), or keep the default --host 127.0.0.1.")
    return None


def checked_origins(origins: list[str]) -> tuple[str, ...]:
    """--allow-origin values: each a web origin, scheme://host[:port] as a browser sends it in Origin."""
    for origin in origins:
        scheme, _, address = origin.partition("://")
        if scheme not in ("http", "https") or not host_name(address) or any(mark in address for mark in "/?#@"):
            raise ConfigError(f"--allow-origin {origin!r} is not a web origin; give it as a browser writes it, "
                              "scheme://host[:port] with nothing after, e.g. http://localhost:3000.")
    return tuple(origins)


def run(model_path: str, options: LoadOptions, host: str, port: int, api_key_env: str | None,
        max_batch_size: int, allow_origins: list[str] = (), named_loras: dict[str, LoraRequest] | None = None) -> None:
    """Loads the model and serves it until SIGINT or SIGTERM, under its folder's name and under each name of
    `named_loras` with those adapters too. Everything the command line gives is checked first."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number; use 1 to 65535 (or 0 for a free one).")
    if max_batch_size < 1:
        raise ConfigError(f"--max-batch-size is {max_batch_size}; it must be at least 1.")
    api_key = api_key_from_env(api_key_env, host)
    origins = checked_origins(list(allow_origins))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.info("loading %s (preset %s, device %s%s)", model_path, options.preset, options.device,
             "".join(f", LoRA {path} at {strength:g}" for path, strength in options.loras))
    model = load_model(model_path, **options.as_kwargs())
    server = ChatServer(model, Path(model_path).name, api_key, max_batch_size, origins, named_loras)
    asyncio.run(_serve(server, host, port))


async def _serve(server: ChatServer, host: str, port: int) -> None:
    # keepalive_timeout closes a connection that has sent no whole request header within it, from its opening or
    # from its last answer (aiohttp starts that timer when the connection opens).
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}). Pick another --port, or stop "
                              "the program using it.") from None
        stopped = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
        bound_port = runner.addresses[0][1]
        shown_host = f"[{host}]" if ":" in host else host
        print(f"A3B server: {server.model_name} at http://{shown_host}:{bound_port}/v1 (Ctrl+C stops it)",
              flush=True)
        await stopped.wait()
    finally:
        await runner.cleanup()
