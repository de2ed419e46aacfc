"""The FastAPI application: OpenAI's completion endpoints on an :class:`~lesson_utils.api.engine_loop.EngineLoop`.

Each request is checked (:func:`~lesson_utils.api.protocol.check_request`), tokenized (a chat request through the
model's chat template), handed to the loop, and answered as the loop's outputs arrive - as server-sent events when
``stream`` is true. A client that goes away is noticed (a failed send, or ``is_disconnected`` while waiting) and its
request is aborted, so its blocks are free before the engine's next step. A full waiting line is a 429 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from lesson_utils.api.engine_loop import EngineLoop, Output, QueueFull, RequestHandle, SamplingParams
from lesson_utils.api.metrics import ServerMetrics
from lesson_utils.api.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_request,
    completion_body,
    max_tokens_of,
    new_id,
    stops_of,
    usage,
)

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25


class _Endpoints:
    """What the routes do, for one served model: tokenize, submit, then answer whole or as a stream."""

    def __init__(self, loop: EngineLoop, model_name: str, max_model_len: int):
        self.loop, self.model_name, self.max_model_len = loop, model_name, max_model_len
        self.tokenizer = loop.tokenizer

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return list(self.tokenizer.encode(body.prompt, add_special_tokens=False))
        return list(body.prompt)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - a template that refuses these messages names why
            raise APIError(400, f"the chat template refused these messages: {err}", "messages") from err
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def serve(self, request: Request, body, prompt_ids: list[int], chat: bool, arrived: float):
        where = "messages" if chat else "prompt"
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", where)
        max_tokens = max_tokens_of(body)
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"the prompt's {len(prompt_ids)} tokens plus max_tokens={max_tokens} exceed the "
                f"model's {self.max_model_len} positions",
                "max_tokens",
                code="context_length_exceeded",
            )
        params = SamplingParams(max_tokens, body.n, body.temperature, body.seed, tuple(stops_of(body)), body.cache_salt)
        aloop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Output] = asyncio.Queue()

        def sink(out: Output) -> None:  # called from the engine loop's thread
            aloop.call_soon_threadsafe(outputs.put_nowait, out)

        try:
            handle = await asyncio.wrap_future(self.loop.submit(prompt_ids, params, sink, arrived))
        except QueueFull as err:
            busy = APIError(429, f"the server is busy: {err}; retry later", type="rate_limit_error", code="queue_full")
            return JSONResponse(busy.body(), 429, headers={"Retry-After": str(RETRY_AFTER_S)})
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), where) from err
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = self.events(request, handle, outputs, rid, chat, body.n, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self.collect(request, handle, outputs, rid, chat, body.n)

    @staticmethod
    async def next_output(request: Request, outputs: asyncio.Queue) -> Output | None:
        """The next output, or None once the client has gone."""
        while True:
            try:
                return await asyncio.wait_for(outputs.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None

    async def collect(self, request: Request, handle: RequestHandle, outputs, rid: str, chat: bool, n: int):
        texts, reasons, errors = [""] * n, [None] * n, []
        try:
            while any(r is None for r in reasons):
                out = await self.next_output(request, outputs)
                if out is None:
                    return Response(status_code=499)  # nobody is listening; the request is aborted below
                texts[out.index] += out.text
                if out.finish_reason is not None:
                    reasons[out.index] = out.finish_reason
                    errors += [out.error] if out.error else []
        finally:
            if not handle.finished:
                self.loop.abort(handle)
        if errors:
            raise APIError(500, errors[0], type="server_error")
        if chat:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r}
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]
        else:
            choices = [
                {"index": i, "text": t, "finish_reason": r, "logprobs": None}
                for i, (t, r) in enumerate(zip(texts, reasons))
            ]
        use = usage(handle.prompt_len, handle.completion_tokens)
        return completion_body(rid, self.model_name, choices, use, chat, chunk=False)

    async def events(self, request, handle: RequestHandle, outputs, rid: str, chat: bool, n: int, include_usage: bool):
        def event(choices, use=None):
            return f"data: {json.dumps(completion_body(rid, self.model_name, choices, use, chat, chunk=True))}\n\n"

        done = 0
        try:
            if chat:
                yield event(
                    [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for i in range(n)
                    ]
                )
            while done < n:
                out = await self.next_output(request, outputs)
                if out is None:
                    return
                if out.error:
                    failure = APIError(500, out.error, type="server_error")
                    yield f"data: {json.dumps(failure.body())}\n\n"
                    return
                done += out.finish_reason is not None
                if out.text or out.finish_reason is not None:
                    key = {"delta": {"content": out.text}} if chat else {"text": out.text, "logprobs": None}
                    yield event([{"index": out.index, **key, "finish_reason": out.finish_reason}])
            if include_usage:
                yield event([], usage(handle.prompt_len, handle.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream (the generator is closed or cancelled)
            if not handle.finished:
                self.loop.abort(handle)


def create_app(loop: EngineLoop, model_name: str, max_model_len: int) -> FastAPI:
    """The app serving ``loop``'s engine as ``model_name`` (its tokenizer: ``loop.tokenizer``)."""
    app = FastAPI(title="PagedAttention course engine", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(loop)
    ends = _Endpoints(loop, model_name, max_model_len)
    app.state.loop, app.state.metrics = loop, metrics

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def malformed(_, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        what = first.get("msg", "malformed request")
        return JSONResponse(APIError(400, f"malformed request: {where or 'body'}: {what}", where).body(), 400)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "owned_by": "pagedattention-course",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.scrape(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return resources.files("lesson_utils.api").joinpath("chat.html").read_text(encoding="utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrived = time.perf_counter()  # the server's clock for this request: before checks and tokenizing
        check_request(body, model_name)
        return await ends.serve(request, body, ends.completion_prompt(body), chat=False, arrived=arrived)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        arrived = time.perf_counter()
        check_request(body, model_name)
        return await ends.serve(request, body, ends.chat_prompt(body), chat=True, arrived=arrived)

    return app
