"""AsyncLLM: the engine for asyncio programs, vLLM-style.

The engine core runs in its own process, as behind `ferrox serve` (which
uses this class for the engine's lifecycle): the caller's event loop only
tokenizes, detokenizes and routes token deltas.

    llm = AsyncLLM("path/to/model", max_num_seqs=64)
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(output.outputs[0].text)          # cumulative; the last has `finished`
    await llm.shutdown()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ferrox.common.config import EngineConfig
from ferrox.common.errors import DuplicateRequestError, EngineDeadError, InvalidArgumentError
from ferrox.common.lora import LoRARequest
from ferrox.common.outputs import RequestOutput
from ferrox.common.protocol import Ready, SequenceDelta
from ferrox.common.sampling_params import SamplingParams
from ferrox.frontend.engine_client import DEFAULT_STALL_TIMEOUT_S, AsyncEngineClient
from ferrox.frontend.replicas import ReplicaPool, replica_pool
from ferrox.frontend.request_run import RequestRun
from ferrox.model_files.tokenizer import load_tokenizer

PromptInput = str | Sequence[int] | dict[str, Any]


class AsyncLLM:
    """An engine in a process of its own, driven from asyncio.

    `AsyncLLM(model, **options)` takes the `LLM` options. The engine process
    starts on the first `generate` (or `await start()`); `shutdown()` stops it.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        engine_stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        data_parallel_size: int = 1,
        routing: str = "prefix",
        **engine_options: Any,
    ) -> None:
        """`engine_stall_timeout`: seconds without a message from the engine
        process after which `client.is_stalled` is set. `data_parallel_size`
        > 1: that many engine replicas, placed by Ray (frontend/replicas.py),
        each request routed by `routing` ("prefix" or "round_robin")."""
        dp = data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise InvalidArgumentError(f"data_parallel_size must be an int >= 1, got {dp!r}")
        self.config = EngineConfig.create(model=model, **engine_options)
        self.tokenizer = load_tokenizer(self.config)
        options = {name: getattr(self.config, name) for name in EngineConfig.field_names()}
        self.client: AsyncEngineClient | ReplicaPool
        if data_parallel_size == 1:
            self.client = AsyncEngineClient(options, stall_timeout=engine_stall_timeout)
        else:
            self.client = replica_pool(options, data_parallel_size, routing, engine_stall_timeout)
        self.info: Ready | None = None
        self._runs: dict[str, RequestRun] = {}
        self._starting: asyncio.Lock | None = None
        self._closed = False

    async def start(self) -> Ready:
        """Starts the engine process (once); its model, limits and KV pool."""
        if self._closed:
            raise EngineDeadError("this AsyncLLM was shut down")
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.info is None:
                self.info = await self.client.start()
        return self.info

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str = "",
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's output after each step that changed it, cumulative
        (whole texts so far); the last one has `finished`. Leaving the loop
        early aborts the request in the engine. `lora_request`: its LoRA
        adapter (None: the base model)."""
        await self.start()
        if not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if request_id in self._runs:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        params = sampling_params or SamplingParams()
        run = RequestRun(
            self.client.pick(ids), self.tokenizer, request_id, ids, params, priority=priority,
            log_request=False, failover=self.client.pick, lora_request=lora_request,
        )  # fmt: skip
        run.state.prompt = text
        self._runs[request_id] = run
        try:
            async for _ in run.updates():
                yield run.state.output()
        finally:
            self._runs.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Ends a request: its `generate` yields a last output whose
        unfinished sequences have finish reason "abort", then stops."""
        run = self._runs.get(request_id)
        stream = self.client.streams.get(request_id)
        if run is None or stream is None:
            return
        for seq in run.seqs:
            if not seq.is_finished:
                stream.put(SequenceDelta(request_id, seq.index, [], finish_reason="abort"))
        self.client.abort(request_id)

    async def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    async def start_profile(self) -> None:
        self.client.start_profile()

    async def stop_profile(self) -> None:
        self.client.stop_profile()

    @property
    def is_running(self) -> bool:
        return self.info is not None and not self._closed and not self.client.is_dead

    async def shutdown(self) -> None:
        """Stops the engine process; requests still running get EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self.client.fail_all(EngineDeadError("the engine was shut down"))
        await self.client.shutdown()

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("this model has no tokenizer: give token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, [int(t) for t in prompt]
        raise InvalidArgumentError(
            "a prompt is a string, a list of token ids, or a dict with 'prompt' / "
            "'prompt_token_ids'"
        )
