"""The completion and chat endpoints: requests in, engine runs, OpenAI
responses or SSE streams out.

Admission: every request holds a place among the server's in-flight
requests from the moment it is admitted until its response ends; past the
bound (or while the server drains) a new request gets 503 with Retry-After
before any work is done for it. Tokenization and chat-template rendering of
large inputs run on a thread pool, not on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ferrox.common.errors import InvalidArgumentError, ServerBusyError
from ferrox.common.multimodal import ImageInput, ImagePrompt
from ferrox.common.outputs import PositionLogprobs
from ferrox.common.sampling_params import SamplingParams
from ferrox.frontend.engine_client import AsyncEngineClient
from ferrox.frontend.media import ImageProcessor, MediaLimits, chat_images, multimodal_prompt
from ferrox.frontend.output_processor import SequenceUpdate
from ferrox.frontend.replicas import ReplicaPool
from ferrox.frontend.request_run import RequestRun, merge, run_to_end
from ferrox.model_files.tokenizer import speaks_harmony
from ferrox.server import openai_protocol as op
from ferrox.server.chat_outputs import ChatOutput
from ferrox.server.error_responses import error_response, exception_response, sse_error
from ferrox.server.lora_adapters import ServerAdapters
from ferrox.server.metrics import Metrics
from ferrox.server.output_constraints import ToolPlan, tool_plan
from ferrox.server.request_fields import OPENAI_FIELDS, FieldRules, check_fields
from ferrox.server.request_translation import (
    ServerLimits,
    chat_messages,
    completion_prompts,
    sampling_params_from,
)

T = TypeVar("T")
_DONE = b"data: [DONE]\n\n"
# Inputs at least this long (characters) are tokenized / rendered off the event loop.
OFFLOAD_CHARS = 4096
TEMPLATE_TIMEOUT_S = 10.0


class ClientGone(Exception):
    pass


def _sse(chunk: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


@dataclass
class ServingContext:
    client: AsyncEngineClient | ReplicaPool
    tokenizer: Any
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    limits: ServerLimits
    metrics: Metrics
    log_token_ids: bool = False
    log_requests: bool = True
    # Sampling defaults from the model's generation config (--generation-config).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_log_len: int | None = None  # token ids of a prompt in its log line
    # Engine requests in flight at most (running and queued); None: no bound.
    max_in_flight: int | None = None
    request_timeout: float | None = None  # seconds, per request
    trust_request_chat_template: bool = False
    # --tool-call-parser (with --enable-auto-tool-choice) and --reasoning-parser.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # JSON schemas' objects allow no unlisted properties (as under strict: true).
    disable_additional_properties: bool = False
    # /v1/responses: how many stored responses are kept (least recently used go first).
    max_stored_responses: int = 1024
    # The model's classifier labels (a cross-encoder's: one); None: it embeds.
    labels: list[str] | None = None
    # LoRA adapters, served under their names as models (server/lora_adapters.py).
    adapters: ServerAdapters = field(default_factory=ServerAdapters)
    # A vision-language model's image processor and how its prompt holds an
    # image (None: the model is text only), and what an image may be.
    images: ImageProcessor | None = None
    image_prompt: ImagePrompt | None = None
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    draining: bool = False
    in_flight: int = 0
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="ferrox-tokenize"
        )
    )

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def all_models(self) -> list[str]:
        """The base model's names and the LoRA adapters' names."""
        return [*self.model_names, *self.adapters.by_name]

    def answering(self, model: str | None) -> str:
        """The model name a response gives: the adapter's, when the request
        named one, else the base model's first name."""
        return model if model in self.adapters.by_name else self.model_name

    def serves(self, model: str) -> bool:
        return model in self.model_names or model in self.adapters.by_name

    @functools.cached_property
    def harmony(self) -> bool:
        """Whether the model answers chats in the harmony format (gpt-oss)."""
        return speaks_harmony(self.tokenizer)

    def admit(self, n: int) -> None:
        """Takes n places among the requests in flight, or raises ServerBusyError."""
        if self.draining:
            self.metrics.requests_rejected.labels(self.model_name, "draining").inc()
            raise ServerBusyError("the server is shutting down; retry on another replica", 5)
        if self.max_in_flight is not None and self.in_flight + n > self.max_in_flight:
            self.metrics.requests_rejected.labels(self.model_name, "capacity").inc()
            raise ServerBusyError(
                f"the server is at capacity ({self.in_flight} requests in flight, at most "
                f"{self.max_in_flight}); retry later"
            )
        self.in_flight += n
        self.metrics.admitted.set(self.in_flight)

    def release(self, n: int) -> None:
        self.in_flight -= n
        self.metrics.admitted.set(self.in_flight)


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), on the thread pool when the input is large."""
        if size < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.ctx.executor, fn, *args)

    # ---- shared ----------------------------------------------------------

    def decode(self, body: bytes, kind: type[T], fields: FieldRules = OPENAI_FIELDS) -> T:
        """The body as `kind`, its top-level fields sorted out by `fields`
        (see `request_fields`)."""
        check_fields(body, kind, fields)  # type: ignore[arg-type]
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, op.BadRequest):  # raised by a struct's own check
                raise e.__cause__ from None
            # msgspec ends its message with the field's path: "... - at `$.n`".
            path = re.search(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)", str(e))
            raise op.BadRequest(f"invalid request: {e}", param=path and path.group(1)) from e
        except msgspec.DecodeError as e:
            raise op.BadRequest(f"the body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise op.BadRequest("the body's JSON nests too deeply") from e

    def check_model(self, model: str | None) -> Response | None:
        if model is not None and not self.ctx.serves(model):
            return error_response(
                404,
                f"the model {model!r} does not exist; this server has {self.ctx.all_models}",
                param="model",
                code="model_not_found",
            )
        return None

    def prompt_text_and_ids(self, prompt: str | list[int]) -> tuple[str, list[int]]:
        """A prompt given as text or as token ids, in both forms."""
        if isinstance(prompt, str):
            return prompt, list(self.ctx.tokenizer.encode(prompt))
        return self.detokenize(prompt), list(prompt)

    async def prompts_text_and_ids(
        self, prompts: list[str | list[int]]
    ) -> list[tuple[str, list[int]]]:
        size = sum(len(p) for p in prompts)
        return await self.offload(size, lambda: [self.prompt_text_and_ids(p) for p in prompts])

    def detokenize(self, token_ids: list[int], param: str = "prompt") -> str:
        """Token ids as text; `param` names the field that held them."""
        bad = [t for t in token_ids if not 0 <= t < self.ctx.vocab_size]
        if bad:
            raise op.BadRequest(
                f"token id {bad[0]} is outside the vocabulary [0, {self.ctx.vocab_size})",
                param=param,
            )
        return str(self.ctx.tokenizer.decode(token_ids))

    def new_run(
        self,
        request_id: str,
        prompt_ids: list[int],
        request: Any,
        tools: ToolPlan | None = None,
        params: SamplingParams | None = None,
        images: list[ImageInput] | None = None,
    ) -> RequestRun:
        """A run of the request's prompt; `params` (else the request's own
        sampling fields) say how."""
        if params is None:
            params = sampling_params_from(
                request,
                max_model_len=self.ctx.max_model_len,
                prompt_len=len(prompt_ids),
                limits=self.ctx.limits,
                defaults=self.ctx.sampling_defaults,
                tool_outputs=tools.structured if tools is not None else None,
                disable_additional_properties=self.ctx.disable_additional_properties,
            )
        if tools is not None and self.ctx.harmony:
            if tools.mode in ("required", "named"):
                raise op.BadRequest(
                    "this model answers in the harmony format, where tool_choice 'required' or "
                    "a named function is not supported; use 'auto'",
                    param="tool_choice",
                )
            # The harmony markers are special tokens: keep them for the parser.
            params = dataclasses.replace(params, skip_special_tokens=False)
        timeout = self.ctx.request_timeout
        return RequestRun(
            client=self.ctx.client.pick(prompt_ids),  # the replica it goes to
            failover=self.ctx.client.pick,
            tokenizer=self.ctx.tokenizer,
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            priority=request.priority,
            lora_request=self.ctx.adapters.by_name.get(getattr(request, "model", None) or ""),
            log_token_ids=self.ctx.log_token_ids,
            log_request=self.ctx.log_requests,
            max_log_len=self.ctx.max_log_len,
            stream=bool(getattr(request, "stream", False)),
            deadline=None if timeout is None else time.monotonic() + timeout,
            images=images,
        )

    async def run_all(self, http: Request, runs: list[RequestRun]) -> None:
        """Runs every request to the end; aborts them all if the client
        disconnects or one of them fails."""
        tasks = [asyncio.create_task(run_to_end(r)) for r in runs]
        disconnect = asyncio.create_task(_wait_disconnect(http))
        try:
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {disconnect}, return_when=asyncio.FIRST_COMPLETED
                )
                if disconnect in done:
                    raise ClientGone
                for task in done:
                    task.result()  # re-raises a failure
                pending.discard(disconnect)
        finally:
            disconnect.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, disconnect, return_exceptions=True)
            self.record(runs)

    def record(self, runs: list[RequestRun]) -> None:
        for run in runs:
            if run.is_finished:
                run.finish(self.ctx.metrics)

    def stream(
        self,
        chunks: AsyncIterator[bytes],
        runs: list[RequestRun],
        admitted: int,
        *,
        done: bytes = _DONE,
        on_error: Callable[[BaseException], bytes] = sse_error,
    ) -> Response:
        """The SSE response; it gives back the request's `admitted` places
        when it ends. `done` ends a whole stream, `on_error` writes the event
        of a failure (OpenAI's by default)."""

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
                if done:
                    yield done
            except Exception as e:
                yield on_error(e)
            finally:
                self.record(runs)

        return _AdmittedStream(
            body(),
            on_close=lambda: self.ctx.release(admitted),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @staticmethod
    def usage(runs: list[RequestRun]) -> op.UsageInfo:
        prompt = sum(len(r.prompt_token_ids) for r in runs)
        completion = sum(r.num_output_tokens for r in runs)
        cached = sum(r.state.num_cached_tokens for r in runs)
        return op.UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=op.PromptTokensDetails(cached_tokens=cached),
        )

    async def handle(
        self,
        http: Request,
        build: Callable[[bytes, list[int]], Any],
        on_error: Callable[[BaseException], Response] = exception_response,
    ) -> Response:
        """Runs one request. `build` admits it (adding its places to the
        list); a non-streamed response gives them back here, a stream when
        it ends. `on_error` answers a failure (in OpenAI's envelope by
        default)."""
        admitted: list[int] = []
        streaming = False
        try:
            response = await build(await http.body(), admitted)
            streaming = isinstance(response, StreamingResponse)
            return response
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            return on_error(e)
        finally:
            if not streaming:
                self.ctx.release(sum(admitted))

    # ---- /v1/completions ---------------------------------------------------

    async def completions(self, http: Request) -> Response:
        return await self.handle(
            http, lambda body, admitted: self._completions(http, body, admitted)
        )

    async def _completions(self, http: Request, body: bytes, admitted: list[int]) -> Response:
        req = self.decode(body, op.CompletionRequest)
        if (missing := self.check_model(req.model)) is not None:
            return missing
        raw_prompts = completion_prompts(req)
        if len(raw_prompts) > self.ctx.limits.max_prompts:
            raise op.BadRequest(
                f"prompt may hold at most {self.ctx.limits.max_prompts} prompts, "
                f"got {len(raw_prompts)}",
                param="prompt",
            )
        self.ctx.admit(len(raw_prompts))
        admitted.append(len(raw_prompts))
        prompts = await self.prompts_text_and_ids(raw_prompts)
        base = op.random_id("cmpl")
        runs = [self.new_run(f"{base}-{i}", ids, req) for i, (_, ids) in enumerate(prompts)]
        texts = [text for text, _ in prompts]
        if req.stream:
            chunks = self._completion_chunks(req, base, runs, texts)
            return self.stream(chunks, runs, admitted.pop())
        await self.run_all(http, runs)
        choices = []
        for i, (run, prompt_text) in enumerate(zip(runs, texts, strict=True)):
            for seq in run.seqs:
                echo = prompt_text if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    entries = self._echo_entries(run) if req.echo else []
                    logprobs = _completion_logprobs(entries + self._seq_entries(run, seq.index), 0)
                choices.append(
                    op.CompletionChoice(
                        index=i * run.params.n + seq.index,
                        text=echo + seq.text,
                        logprobs=logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        response = op.CompletionResponse(
            id=base, model=self.ctx.answering(req.model), choices=choices, usage=self.usage(runs)
        )
        return Response(msgspec.json.encode(response), media_type="application/json")

    async def _completion_chunks(
        self, req: op.CompletionRequest, base: str, runs: list[RequestRun], texts: list[str]
    ) -> AsyncIterator[bytes]:
        model = self.ctx.answering(req.model)
        if req.echo:
            for i, (run, text) in enumerate(zip(runs, texts, strict=True)):
                for seq in run.seqs:
                    choice = op.CompletionChoice(index=i * run.params.n + seq.index, text=text)
                    yield _sse(op.CompletionStreamResponse(id=base, model=model, choices=[choice]))
        async for i, upd in merge(runs):
            if not (upd.text or upd.finish_reason or upd.token_ids):
                continue
            logprobs = None
            if req.logprobs is not None and upd.logprobs is not None:
                logprobs = _completion_logprobs(
                    list(zip(upd.token_ids, upd.logprobs, strict=True)), 0
                )
            choice = op.CompletionChoice(
                index=i * runs[i].params.n + upd.index,
                text=upd.text,
                logprobs=logprobs,
                finish_reason=upd.finish_reason,
                stop_reason=upd.stop_reason,
            )
            yield _sse(op.CompletionStreamResponse(id=base, model=model, choices=[choice]))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse(
                op.CompletionStreamResponse(
                    id=base, model=model, choices=[], usage=self.usage(runs)
                )
            )

    def _seq_entries(
        self, run: RequestRun, index: int
    ) -> list[tuple[int, PositionLogprobs | None]]:
        seq = run.seqs[index]
        logprobs: list[PositionLogprobs | None] = [None] * len(seq.token_ids)
        if seq.logprobs is not None:
            logprobs = list(seq.logprobs)
        return list(zip(seq.token_ids, logprobs, strict=True))

    def _echo_entries(self, run: RequestRun) -> list[tuple[int, PositionLogprobs | None]]:
        prompt_lp = run.prompt_logprobs or [None] * len(run.prompt_token_ids)
        return list(zip(run.prompt_token_ids, prompt_lp, strict=True))

    # ---- /v1/chat/completions ----------------------------------------------

    async def chat(self, http: Request) -> Response:
        return await self.handle(http, lambda body, admitted: self._chat(http, body, admitted))

    async def chat_prompt_async(
        self, req: op.ChatCompletionRequest | op.TokenizeRequest
    ) -> ChatPrompt:
        """chat_prompt, off the event loop for large inputs and for images,
        within a time bound."""
        size = sum(_message_size(m) for m in req.messages or [])
        if getattr(req, "chat_template", None) is None and size < OFFLOAD_CHARS:
            return self.chat_prompt(req)
        future = asyncio.get_running_loop().run_in_executor(
            self.ctx.executor, self.chat_prompt, req
        )
        try:
            return await asyncio.wait_for(future, TEMPLATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise op.BadRequest(
                f"rendering the chat template took more than {TEMPLATE_TIMEOUT_S:.0f} s",
                param="messages",
            ) from None

    def chat_prompt(self, req: op.ChatCompletionRequest | op.TokenizeRequest) -> ChatPrompt:
        """The conversation's prompt ids and, for a vision-language model,
        its processed images (their placeholders expanded in the ids)."""
        template = getattr(req, "chat_template", None)
        if template is not None and not self.ctx.trust_request_chat_template:
            raise op.BadRequest(
                "chat templates in requests are refused; the server's operator may allow them "
                "with --trust-request-chat-template",
                param="chat_template",
            )
        messages, images = self._chat_images(chat_messages(req))
        continue_final = getattr(req, "continue_final_message", False)
        if continue_final and (req.add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise op.BadRequest(
                "continue_final_message needs add_generation_prompt false and an assistant "
                "message last",
                param="continue_final_message",
            )
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        reserved = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
        if reserved:
            raise op.BadRequest(
                f"chat_template_kwargs may not set {reserved}: they are request fields",
                param="chat_template_kwargs",
            )
        tools = getattr(req, "tools", None)
        if tools:
            kwargs["tools"] = [msgspec.to_builtins(tool) for tool in tools]
        try:
            text = self.ctx.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=continue_final,
                chat_template=template,
                **kwargs,
            )
        except op.BadRequest:
            raise
        except Exception as e:
            raise op.BadRequest(f"cannot apply the chat template: {e}", param="messages") from e
        special = getattr(req, "add_special_tokens", False) and isinstance(
            req, op.ChatCompletionRequest
        )
        if not images:
            return ChatPrompt(list(self.ctx.tokenizer.encode(text, add_special_tokens=special)))
        assert self.ctx.images is not None and self.ctx.image_prompt is not None
        try:
            processed = self.ctx.images.process(images)
            return ChatPrompt(
                *multimodal_prompt(
                    text, self.ctx.tokenizer, self.ctx.image_prompt, processed, special
                )
            )
        except InvalidArgumentError as e:
            raise op.BadRequest(str(e), param="messages") from e

    def _chat_images(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages as the chat template takes them, and their images
        (loaded, checked and decoded)."""
        has_images = any(isinstance(m["content"], list) for m in messages)
        if has_images and self.ctx.images is None:
            raise op.BadRequest(
                "this server's model takes no images (it is not a vision-language model)",
                param="messages",
            )
        try:
            return chat_images(messages, self.ctx.media_limits)
        except InvalidArgumentError as e:
            raise op.BadRequest(str(e), param="messages") from e

    async def _chat(self, http: Request, body: bytes, admitted: list[int]) -> Response:
        req = self.decode(body, op.ChatCompletionRequest)
        if (missing := self.check_model(req.model)) is not None:
            return missing
        tools = tool_plan(req, self.ctx.tool_parser, self.ctx.disable_additional_properties)
        self.ctx.admit(1)
        admitted.append(1)
        prompt = await self.chat_prompt_async(req)
        run = self.new_run(op.random_id("chatcmpl"), prompt.ids, req, tools, images=prompt.images)
        if req.stream:
            return self.stream(self._chat_chunks(req, run, tools), [run], admitted.pop())
        await self.run_all(http, [run])
        choices = []
        for seq in run.seqs:
            out = self.chat_output(tools)
            out.feed(seq.text, final=True)
            message = out.message()
            if not req.include_reasoning:
                message.reasoning_content = None
            choices.append(
                op.ChatCompletionChoice(
                    index=seq.index,
                    message=message,
                    logprobs=_chat_logprobs(seq.logprobs, req.top_logprobs)
                    if req.logprobs
                    else None,
                    finish_reason=out.finish_reason(seq.finish_reason),
                    stop_reason=seq.stop_reason,
                )
            )
        response = op.ChatCompletionResponse(
            id=run.request_id,
            model=self.ctx.answering(req.model),
            choices=choices,
            usage=self.usage([run]),
        )
        return Response(msgspec.json.encode(response), media_type="application/json")

    def chat_output(self, tools: ToolPlan) -> ChatOutput:
        return ChatOutput(
            reasoning_parser=self.ctx.reasoning_parser,
            tool_mode=tools.mode,
            tool_parser=self.ctx.tool_parser,
            tool_name=tools.name,
            harmony=self.ctx.harmony,
        )

    async def _chat_chunks(
        self, req: op.ChatCompletionRequest, run: RequestRun, tools: ToolPlan
    ) -> AsyncIterator[bytes]:
        model, rid = self.ctx.answering(req.model), run.request_id

        def chunk(choices: list[op.ChatCompletionStreamChoice], **kw: Any) -> bytes:
            return _sse(op.ChatCompletionStreamResponse(id=rid, model=model, choices=choices, **kw))

        outputs = {}
        for seq in run.seqs:
            outputs[seq.index] = self.chat_output(tools)
            delta = op.DeltaMessage(role="assistant", content="")
            yield chunk([op.ChatCompletionStreamChoice(index=seq.index, delta=delta)])
        async for _, upd in merge([run]):
            if not (upd.text or upd.finish_reason):
                continue
            out = outputs[upd.index]
            piece = out.feed(upd.text, final=upd.finish_reason is not None)
            logprobs = None
            if req.logprobs and upd.logprobs is not None:
                logprobs = _chat_logprobs(upd.logprobs, req.top_logprobs)
            delta = op.DeltaMessage(
                content=piece.content or None,
                reasoning_content=(piece.reasoning if req.include_reasoning else "") or None,
                tool_calls=piece.tool_deltas or None,
            )
            if not (upd.finish_reason or logprobs or delta != op.DeltaMessage()):
                continue  # text held back (a tag may be starting)
            choice = op.ChatCompletionStreamChoice(
                index=upd.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=out.finish_reason(upd.finish_reason),
                stop_reason=upd.stop_reason,
            )
            yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=self.usage([run]))


# apply_chat_template's own arguments, which chat_template_kwargs may not set.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class _AdmittedStream(StreamingResponse):
    """A stream that gives back its request's admission places however it
    ends: finished, failed, or the client gone before its body even began."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            # Close the body now (its runs abort in the engine), not at
            # garbage collection, when the client left in the middle.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()


@dataclass
class ChatPrompt:
    """A rendered conversation: its token ids and its images."""

    ids: list[int]
    images: list[ImageInput] | None = None


def _message_size(message: op.ChatMessageParam) -> int:
    content = message.content
    if isinstance(content, str):
        return len(content)
    # An image part always goes off the event loop (decoding, the processor).
    return sum(
        len(part.text or "") + OFFLOAD_CHARS * (part.image_url is not None)
        for part in content or []
    )


async def _wait_disconnect(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _token_text(entry: PositionLogprobs | None, token: int) -> str:
    if entry is not None and token in entry and entry[token].decoded_token is not None:
        return str(entry[token].decoded_token)
    return ""


def _completion_logprobs(
    entries: list[tuple[int, PositionLogprobs | None]], offset: int
) -> op.CompletionLogprobs:
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, entry in entries:
        text = _token_text(entry, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[token].logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
    return op.CompletionLogprobs(
        tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets
    )


def _chat_logprobs(entries: list[PositionLogprobs] | None, top: int | None) -> op.ChatLogprobs:
    content = []
    for entry in entries or []:
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)
        chosen = next(iter(entry.values()))  # the sampled token comes first
        text = chosen.decoded_token or ""
        content.append(
            op.ChatLogprobToken(
                token=text,
                logprob=chosen.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    op.TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=lp.logprob,
                        bytes=list((lp.decoded_token or "").encode()),
                    )
                    for lp in ranked[: top or 0]
                ],
            )
        )
    return op.ChatLogprobs(content=content)


__all__ = ["OpenAIServing", "SequenceUpdate", "ServingContext"]
