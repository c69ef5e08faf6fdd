"""vLLM's command-line conventions that `ferrox serve` follows: flags ferrox
refuses with a reason, JSON-list flags, the generation config's sampling
defaults, and a chat template given as a file or inline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ferrox.model_files.hub import resolve_model_path
from ferrox.server.chat_outputs import REASONING_PARSERS, TOOL_CALL_PARSERS
from ferrox.server.output_constraints import GRAMMAR_BACKENDS

# vLLM flags a launch command often carries that ferrox cannot honour, and why.
UNSUPPORTED_VLLM_FLAGS = {
    "--pipeline-parallel-size": "ferrox has no pipeline parallelism",
    "--trust-remote-code": "ferrox runs no code from model repositories",
    "--cpu-offload-gb": "ferrox does not offload weights",
    "--swap-space": "ferrox recomputes preempted requests instead of swapping",
    "--revision": "hub models resolve to their default revision",
    "--tokenizer-mode": "ferrox uses the model's fast tokenizer",
    "--download-dir": "hub models go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE)",
    "--max-seq-len-to-capture": "CUDA graphs cover decode batches up to --max-num-seqs",
    "--compilation-config": "ferrox does not use torch.compile",
    "--num-scheduler-steps": "ferrox schedules every step",
}


def check_unsupported_flags(argv: list[str]) -> None:
    """Stops with a clear message for a vLLM flag ferrox cannot honour."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in UNSUPPORTED_VLLM_FLAGS:
            raise SystemExit(
                f"ferrox serve: {flag} is a vLLM option ferrox does not support: "
                f"{UNSUPPORTED_VLLM_FLAGS[flag]}"
            )


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


# generation_config.json keys -> SamplingParams fields
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(option: str, model: str | None) -> dict[str, Any]:
    """The sampling defaults --generation-config names (see its help)."""
    if option == "vllm":
        return {}
    if option == "auto":
        source = resolve_model_path(model)
        if not source.is_dir():
            return {}  # a GGUF file carries no generation config
    else:
        source = Path(option)
    file = source / "generation_config.json" if source.is_dir() else source
    if not file.is_file():
        if option == "auto":
            return {}
        raise SystemExit(f"ferrox serve: --generation-config {option!r}: no generation config")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise SystemExit(f"ferrox serve: cannot read {file}: {e}") from e
    return {
        ours: data[theirs]
        for theirs, ours in _GENERATION_KEYS.items()
        if data.get(theirs) is not None
    }


def chat_template_text(value: str) -> str:
    """--chat-template: a file's contents, or the template itself."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(
            f"ferrox serve: --chat-template {value!r} is neither a file nor a template"
        )
    return value


def add_chat_output_arguments(group: argparse._ArgumentGroup) -> None:
    """Tool calling, reasoning and the structured-output backend, as vLLM names them."""
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model family's tool-call format: hermes (<tool_call> JSON: Qwen2.5, Qwen3, "
        "Hermes) or llama3_json (Llama 3.1+)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="put the model's <think> block into reasoning_content",
    )
    group.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_config,
        default=None,
        help='JSON, e.g. {"backend": "guidance", "disable_additional_properties": true}: '
        "ferrox's grammar engine is llguidance; disable_additional_properties makes every "
        "JSON schema's objects that list their properties allow no others (as strict: true)",
    )
    group.add_argument(
        "--guided-decoding-backend",
        choices=GRAMMAR_BACKENDS,
        default=None,
        help="accepted for vLLM launch commands; the grammar engine is llguidance",
    )


def tool_parser_option(args: argparse.Namespace) -> str | None:
    """The parser of tool_choice "auto", or None; both flags go together."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit(
            "ferrox serve: --enable-auto-tool-choice and --tool-call-parser go together"
        )
    return args.tool_call_parser


def disable_additional_properties_option(args: argparse.Namespace) -> bool:
    """--structured-outputs-config's disable_additional_properties."""
    return bool((args.structured_outputs_config or {}).get("disable_additional_properties"))


def _structured_outputs_config(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or set(value) - {"backend", "disable_additional_properties"}:
        raise argparse.ArgumentTypeError(
            'expected a JSON object with at most the keys "backend" and '
            f'"disable_additional_properties", got {text!r}'
        )
    if not isinstance(value.get("disable_additional_properties", False), bool):
        raise argparse.ArgumentTypeError(
            f"disable_additional_properties must be true or false, got {text!r}"
        )
    if value.get("backend", "auto") not in GRAMMAR_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"backend must be one of {list(GRAMMAR_BACKENDS)} (the grammar engine is "
            f"llguidance), got {value['backend']!r}"
        )
    return value
