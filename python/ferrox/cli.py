"""The `ferrox` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from typing import Any

import ferrox
from ferrox.common.engine_args import add_engine_arguments, engine_options
from ferrox.common.errors import FerroxError
from ferrox.common.runtime import __version__


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.95)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace) -> ferrox.SamplingParams:
    return ferrox.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _stream(llm: ferrox.LLM, prompt_ids: list[int], params: ferrox.SamplingParams) -> Iterator[str]:
    """Yields text as the engine produces it."""
    for out in llm.stream_outputs(["cli-0"], [(None, prompt_ids)], [params], stream=True):
        for completion in out.outputs:
            if completion.text:
                yield completion.text


def cmd_generate(args: argparse.Namespace) -> int:
    llm = ferrox.LLM(**engine_options(args))
    params = _sampling_params(args)
    tokenizer = llm.get_tokenizer()
    if args.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    for piece in _stream(llm, prompt_ids, params):
        print(piece, end="", flush=True)
    print()
    return 0


def cmd_chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> int:
    llm = ferrox.LLM(**engine_options(args))
    tokenizer = llm.get_tokenizer()
    params = _sampling_params(args)
    history: list[dict[str, Any]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("ferrox chat: /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            del history[1 if args.system else 0 :]
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        reply = []
        try:
            for piece in _stream(llm, prompt_ids, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrox", description="ferrox: LLM inference with a Rust scheduling core"
    )
    parser.add_argument("--version", action="version", version=f"ferrox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="wrap the prompt as a user message in the model's chat template",
    )
    _sampling_arguments(gen)
    add_engine_arguments(gen)
    gen.set_defaults(handler=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming the replies")
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(handler=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from ferrox.server.launch import add_server_arguments
    from ferrox.server.launch import serve as run_server

    add_server_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(handler=run_server)

    bench = sub.add_parser("bench", help="benchmarks: serve (load a server), latency (one batch)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from ferrox.bench import latency as bench_latency
    from ferrox.bench import serve as bench_serve

    bench_serve_parser = bench_sub.add_parser("serve", help="load an OpenAI-compatible server")
    bench_serve.add_arguments(bench_serve_parser)
    bench_serve_parser.set_defaults(handler=bench_serve.main)
    bench_latency_parser = bench_sub.add_parser(
        "latency", help="prefill and decode time of a batch"
    )
    bench_latency.add_arguments(bench_latency_parser)
    bench_latency_parser.set_defaults(handler=bench_latency.main)

    info = sub.add_parser("info", help="print the version, the device and the resolved config")
    add_engine_arguments(info)
    info.set_defaults(handler=cmd_info)
    return parser


def cmd_info(args: argparse.Namespace) -> int:
    from ferrox.common.config import EngineConfig
    from ferrox.parallel.device import torch_device, torch_dtype

    config = EngineConfig.create(**engine_options(args))
    print(f"ferrox {__version__}")
    print(f"device: {torch_device(config)}, dtype: {torch_dtype(config)}")
    print(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["serve"]:
        from ferrox.server.vllm_options import check_unsupported_flags

        check_unsupported_flags(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except FerroxError as e:
        print(f"ferrox: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
