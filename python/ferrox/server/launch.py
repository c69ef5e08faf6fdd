"""`ferrox serve`: the frontend process (uvicorn + uvloop) in front of an
engine-core process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from ferrox.common.engine_args import add_engine_arguments, engine_options
from ferrox.common.errors import ServerBusyError
from ferrox.common.lora import LoraTargets
from ferrox.common.protocol import Ready
from ferrox.common.runtime import freeze_long_lived_objects, thaw_long_lived_objects
from ferrox.frontend.async_llm import AsyncLLM
from ferrox.frontend.engine_client import DEFAULT_STALL_TIMEOUT_S
from ferrox.frontend.media import ImageProcessor, MediaLimits
from ferrox.frontend.replicas import ROUTING_POLICIES
from ferrox.model_files.hub import is_hub_id
from ferrox.server.app import CorsOptions, build_app
from ferrox.server.lora_adapters import ServerAdapters, parse_lora_module
from ferrox.server.metrics import Metrics
from ferrox.server.request_translation import ServerLimits
from ferrox.server.serving import ServingContext
from ferrox.server.vllm_options import (
    add_chat_output_arguments,
    chat_template_text,
    check_unsupported_flags,
    disable_additional_properties_option,
    generation_defaults,
    json_list,
    non_negative_int,
    positive_float,
    positive_int,
    tool_parser_option,
)

logger = logging.getLogger("ferrox.server")
DEATH_GRACE_SECONDS = 2.0


DRAIN_POLL_S = 0.05
FLUSH_SECONDS = 2.0  # after ending the last requests, for their responses to go out


class _Server(uvicorn.Server):
    """Drains on SIGTERM / SIGINT, then exits with status 0 (uvicorn would
    re-raise the signal after its shutdown): /health and new requests answer
    503 while in-flight requests finish, for at most `drain_timeout` seconds;
    those still running then end with an error (an error event and [DONE] on
    a stream). A second SIGINT stops at once."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, drain_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.ctx.draining or self.loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
            self.should_exit = True
            return
        self.ctx.draining = True
        self.loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, name: str) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(name))

    async def _drain(self, name: str) -> None:
        ctx = self.ctx
        logger.info(
            "%s: draining %d requests in flight (at most %.0f s); new requests get 503",
            name,
            ctx.in_flight,
            self.drain_timeout,
        )
        deadline = time.monotonic() + self.drain_timeout
        while ctx.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if ctx.in_flight > 0:
            ctx.client.refuse_new = True
            ended = ctx.client.fail_all(
                ServerBusyError("the server shut down before the request finished", 5)
            )
            logger.warning("drain timeout: ended %d requests still running", ended)
            flush = time.monotonic() + FLUSH_SECONDS
            while ctx.in_flight > 0 and time.monotonic() < flush:
                await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model directory, .gguf file or Hugging Face hub id (the same as --model)",
    )
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--api-key",
        default=os.environ.get("FERROX_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route but /health "
        "(default: $FERROX_API_KEY)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        action="extend",
        default=None,
        help="name(s) clients use for the model; the first is reported (default: the model "
        "argument: a hub id as given, a path's last part)",
    )
    group.add_argument("--allowed-origins", type=json_list, default=["*"],
                       help='CORS origins, a JSON list (default: ["*"])')  # fmt: skip
    group.add_argument("--allowed-methods", type=json_list, default=["*"])
    group.add_argument("--allowed-headers", type=json_list, default=["*"])
    group.add_argument("--allow-credentials", action="store_true")
    group.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) instead of the model's",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a "
        "folder / file holding a generation_config.json",
    )
    group.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per finished request"
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM's command lines: ferrox logs no periodic stats (see /metrics)",
    )
    group.add_argument(
        "--max-log-len",
        type=non_negative_int,
        default=None,
        help="most token ids of a prompt the request log line prints (with --log-token-ids)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    group.add_argument(
        "--max-body-bytes", type=non_negative_int, default=8 << 20, help="largest request body"
    )
    group.add_argument(
        "--max-stored-responses",
        type=non_negative_int,
        default=ServingContext.max_stored_responses,
        help="how many /v1/responses results are kept in memory for previous_response_id and "
        "GET (least recently used go first; 0: none)",
    )
    limits = ServerLimits()  # the one definition of the defaults
    group.add_argument(
        "--max-n", type=int, default=limits.max_n, help="largest `n` a request may ask for"
    )
    group.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings)
    group.add_argument("--max-stop-string-len", type=int, default=limits.max_stop_string_len)
    group.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                       help="most prompts one completions request may hold")  # fmt: skip
    group.add_argument("--max-logit-bias", type=int, default=limits.max_logit_bias)
    group.add_argument("--max-stop-token-ids", type=int, default=limits.max_stop_token_ids)
    group.add_argument(
        "--request-timeout",
        type=positive_float,
        default=None,
        help="seconds a request may take before it is aborted with 408 (default: no limit)",
    )
    group.add_argument(
        "--engine-stall-timeout",
        type=positive_float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="seconds without a message from the engine (it sends one every second) after "
        "which /health answers 503",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat template (refused by default)",
    )
    media = MediaLimits()  # the one definition of the defaults
    group.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="host names image_url parts may be fetched from over http(s) (default: none; "
        "data URLs are always accepted)",
    )
    group.add_argument(
        "--max-image-bytes",
        type=non_negative_int,
        default=media.max_bytes,
        help="largest encoded image a request may carry or have fetched",
    )
    group.add_argument(
        "--max-image-pixels",
        type=non_negative_int,
        default=media.max_pixels,
        help="most pixels (width x height) an image may have, checked before decoding it",
    )
    group.add_argument(
        "--media-fetch-timeout",
        type=positive_float,
        default=media.fetch_timeout_s,
        help="seconds an image fetch from an allowed domain may take",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / SIGINT, seconds to let in-flight requests finish before ending them",
    )
    group.add_argument(
        "--log-token-ids",
        action="store_true",
        help="log the prompt and output token ids of every finished request",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    group = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters served under their names as models: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths inside "
        "--lora-dir only)",
    )
    group.add_argument(
        "--lora-dir",
        type=Path,
        default=None,
        help="the directory runtime-loaded adapters must lie in",
    )
    group = parser.add_argument_group("data parallelism")
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="engine replicas, placed by Ray (a local Ray unless RAY_ADDRESS names a cluster); "
        "each request goes to one (default: 1, no Ray)",
    )
    group.add_argument(
        "--data-parallel-routing",
        choices=list(ROUTING_POLICIES),
        default="prefix",
        help="prefix: the replica that holds the longest prefix of the prompt, unless it is "
        "much busier than the least busy one; round_robin: in turn (default: prefix)",
    )
    add_chat_output_arguments(
        parser.add_argument_group("tool calling, reasoning, structured outputs")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrox serve", description="OpenAI-compatible server (completions, chat, metrics)"
    )
    add_server_arguments(parser)
    add_engine_arguments(parser)
    return parser


@dataclass
class ServerApp:
    """The OpenAI application over an engine that starts with it (the
    application's lifespan), before anything serves it: uvicorn here, or a
    Ray Serve replica (`ferrox.server.ray_serve`)."""

    app: Starlette
    ctx: ServingContext
    engine: AsyncLLM
    names: list[str]


def build_server_app(
    args: argparse.Namespace,
    on_dead: Callable[[str], None],
    on_started: Callable[[Ready], None] | None = None,
) -> ServerApp:
    """`on_dead(message)` runs once the engine has stopped (its requests
    already failed); `on_started(info)` once it is ready."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(
                f"ferrox serve: the model is given twice ({args.model_tag!r} and --model "
                f"{args.model!r})"
            )
        args.model = args.model_tag
    options = engine_options(args)
    adapters = server_adapters(args)
    tool_parser = tool_parser_option(args)
    # The engine process starts with the application (lifespan below).
    engine = AsyncLLM(
        engine_stall_timeout=args.engine_stall_timeout,
        data_parallel_size=args.data_parallel_size,
        routing=args.data_parallel_routing,
        **options,
    )
    config, tokenizer = engine.config, engine.tokenizer
    if tokenizer is None:
        raise SystemExit("ferrox serve needs a model with a tokenizer")
    if args.chat_template is not None:
        tokenizer.chat_template = chat_template_text(args.chat_template)
    names = args.served_model_name or [_default_name(config.model)]
    sampling_defaults = generation_defaults(args.generation_config, config.model)
    if sampling_defaults:
        logger.info("sampling defaults from the generation config: %s", sampling_defaults)
    client = engine.client
    ctx = ServingContext(
        client=client,
        tokenizer=tokenizer,
        model_names=names,
        max_model_len=0,
        vocab_size=0,
        limits=ServerLimits(
            max_n=args.max_n,
            max_logprobs=config.max_logprobs,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_len=args.max_stop_string_len,
            max_prompts=args.max_prompts,
            max_logit_bias=args.max_logit_bias,
            max_stop_token_ids=args.max_stop_token_ids,
        ),
        metrics=Metrics(names[0], client.replica_stats),
        log_token_ids=args.log_token_ids,
        log_requests=not args.disable_log_requests,
        sampling_defaults=sampling_defaults,
        max_log_len=args.max_log_len,
        max_in_flight=config.max_admitted_requests,
        request_timeout=args.request_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_parser=tool_parser,
        reasoning_parser=args.reasoning_parser,
        disable_additional_properties=disable_additional_properties_option(args),
        max_stored_responses=args.max_stored_responses,
        adapters=adapters,
        media_limits=MediaLimits(
            max_bytes=args.max_image_bytes,
            max_pixels=args.max_image_pixels,
            fetch_timeout_s=args.media_fetch_timeout,
            allowed_domains=tuple(d.lower() for d in args.allowed_media_domains),
        ),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        info = await engine.start()
        ctx.max_model_len = info.max_model_len
        ctx.vocab_size = info.vocab_size
        ctx.labels = info.labels
        if info.image_prompt is not None:
            # The model's image processor, in a child process (it needs torch).
            ctx.images = ImageProcessor(Path(info.model), in_process=False)
            ctx.image_prompt = info.image_prompt
        if info.lora_modules is not None:
            shapes = {name: (s[0], s[1]) for name, s in info.lora_modules.items()}
            adapters.targets = LoraTargets(info.lora_layers, shapes)
            adapters.check_all()
        client.on_dead = on_dead
        client.on_step = ctx.metrics.iteration_tokens.observe
        ctx.metrics.set_cache_config(
            block_size=info.block_size,
            num_blocks=info.num_kv_blocks,
            prefix_caching=config.enable_prefix_caching,
            dtype=info.kv_dtype,
        )
        if on_started is not None:
            on_started(info)
        try:
            yield
        finally:
            await engine.shutdown()
            if ctx.images is not None:
                ctx.images.close()

    app = build_app(
        ctx,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        lifespan=lifespan,
        profiling=config.profiler_dir is not None,
        cors=CorsOptions(
            origins=args.allowed_origins,
            methods=args.allowed_methods,
            headers=args.allowed_headers,
            credentials=args.allow_credentials,
        ),
    )
    return ServerApp(app=app, ctx=ctx, engine=engine, names=names)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    exit_code = 0
    server: _Server | None = None

    def on_dead(message: str) -> None:
        # Fail fast but visibly: /health answers 503 for a moment (in-flight
        # requests have already been failed), then the server exits non-zero.
        nonlocal exit_code
        exit_code = 1

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, stop)

    def on_started(info: Ready) -> None:
        if server is not None:
            server.loop = asyncio.get_running_loop()
        print(
            f"ferrox: serving {parts.names[0]!r} ({info.model}) at http://{args.host}:{args.port} "
            f"(on {info.device} in {info.dtype}, max_model_len {info.max_model_len}, "
            f"{info.num_kv_blocks} KV blocks of "
            f"{info.block_size} tokens, loaded in {info.load_seconds:.1f} s)",
            flush=True,
        )
        # This process serves this one application until it ends: the
        # tokenizer's, the libraries' and the routes' objects stay out of the
        # collector's full scans, pauses of every stream's events.
        freeze_long_lived_objects()

    parts = build_server_app(args, on_dead, on_started)
    server = _Server(
        uvicorn.Config(
            parts.app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            lifespan="on",
            # Requests are drained before uvicorn's own shutdown starts.
            timeout_graceful_shutdown=int(FLUSH_SECONDS) + 1,
            log_level=args.uvicorn_log_level,
            access_log=False,
        ),
        parts.ctx,
        args.shutdown_timeout,
    )
    server.run()
    thaw_long_lived_objects()
    if not server.started and exit_code == 0:
        return 1  # the engine or the socket failed at start-up
    return exit_code


def server_adapters(args: argparse.Namespace) -> ServerAdapters:
    """The adapters of --lora-modules, and whether runtime updates are on."""
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise SystemExit(
            "ferrox serve: --lora-modules and --allow-runtime-lora-updating need --enable-lora"
        )
    if args.allow_runtime_lora_updating and args.lora_dir is None:
        raise SystemExit(
            "ferrox serve: --allow-runtime-lora-updating needs --lora-dir, the directory "
            "runtime adapters must lie in"
        )
    adapters = ServerAdapters(
        max_rank=args.max_lora_rank,
        runtime_updates=args.allow_runtime_lora_updating,
        lora_dir=args.lora_dir,
    )
    served = set(args.served_model_name or [])
    for module in args.lora_modules:
        if module.lora_name in served:
            raise SystemExit(f"ferrox serve: {module.lora_name!r} names the base model too")
        try:
            adapters.add(module.lora_name, module.lora_path, module.base_model_name)
        except ValueError as e:
            raise SystemExit(f"ferrox serve: --lora-modules: {e}") from None
    return adapters


def _default_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if is_hub_id(model) and not Path(model).exists():
        return model  # as vLLM names a hub model: its id
    return Path(model).name.removesuffix(".gguf")


def main(argv: list[str] | None = None) -> int:
    check_unsupported_flags(sys.argv[1:] if argv is None else argv)
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
