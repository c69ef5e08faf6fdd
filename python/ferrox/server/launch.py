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
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from ferrox.cli_options import add_engine_arguments, engine_options
from ferrox.config import EngineConfig
from ferrox.frontend.engine_client import AsyncEngineClient
from ferrox.loader.model_loader import load_tokenizer
from ferrox.server.app import build_app
from ferrox.server.metrics import Metrics
from ferrox.server.request_translation import ServerLimits
from ferrox.server.serving import ServingContext

logger = logging.getLogger("ferrox.server")
DEATH_GRACE_SECONDS = 2.0


class _Server(uvicorn.Server):
    """Stops gracefully on SIGTERM / SIGINT and then exits with status 0
    (uvicorn would re-raise the signal after its shutdown)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
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
        action="append",
        default=None,
        help="name(s) clients use for the model (default: the model path's name)",
    )
    group.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body")
    limits = ServerLimits()  # the one definition of the defaults
    group.add_argument(
        "--max-n", type=int, default=limits.max_n, help="largest `n` a request may ask for"
    )
    group.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings)
    group.add_argument("--max-stop-string-len", type=int, default=limits.max_stop_string_len)
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / SIGINT, seconds to let in-flight requests finish before aborting them",
    )
    group.add_argument(
        "--log-token-ids",
        action="store_true",
        help="log the prompt and output token ids of every finished request",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrox serve", description="OpenAI-compatible server (completions, chat, metrics)"
    )
    add_server_arguments(parser)
    add_engine_arguments(parser)
    return parser


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    options = engine_options(args)
    config = EngineConfig.create(**options)  # fail fast on bad options
    tokenizer = load_tokenizer(config)
    if tokenizer is None:
        raise SystemExit("ferrox serve needs a model with a tokenizer")
    names = args.served_model_name or [_default_name(config.model)]
    client = AsyncEngineClient(options)
    exit_code = 0
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
        ),
        metrics=Metrics(names[0], lambda: client.stats),
        log_token_ids=args.log_token_ids,
    )
    server: uvicorn.Server | None = None

    def on_dead(message: str) -> None:
        # Fail fast but visibly: /health answers 503 for a moment (in-flight
        # requests have already been failed), then the server exits non-zero.
        nonlocal exit_code
        exit_code = 1

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, stop)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        info = await client.start()
        ctx.max_model_len = info.max_model_len
        ctx.vocab_size = info.vocab_size
        client.on_dead = on_dead
        print(
            f"ferrox: serving {names[0]!r} ({info.model}) at http://{args.host}:{args.port} "
            f"(max_model_len {info.max_model_len}, {info.num_kv_blocks} KV blocks of "
            f"{info.block_size} tokens, loaded in {info.load_seconds:.1f} s)",
            flush=True,
        )
        try:
            yield
        finally:
            await client.shutdown()

    app = build_app(
        ctx, api_key=args.api_key, max_body_bytes=args.max_body_bytes, lifespan=lifespan
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            lifespan="on",
            timeout_graceful_shutdown=max(int(args.shutdown_timeout), 1),
            log_level="warning",
            access_log=False,
        )
    )
    server.run()
    if not server.started and exit_code == 0:
        return 1  # the engine or the socket failed at start-up
    return exit_code


def _default_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return Path(model).name.removesuffix(".gguf")


def main(argv: list[str] | None = None) -> int:
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
