"""LoRA adapters, without torch: the request that names one (`LoRARequest`,
as vLLM spells it) and the checks of an adapter directory in PEFT's format
against the model it would run on (`read_adapter`).

An adapter directory holds `adapter_config.json` and
`adapter_model.safetensors`. Its tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`:
A is [r, in_features], B is [out_features, r], and the delta a module adds
to its output is `scale * B @ A @ x` with `scale = lora_alpha / r`
(`lora_alpha / sqrt(r)` under rsLoRA). The checks read the config and the
safetensors header only (a JSON table of names, dtypes and shapes at the
file's start), so the server's frontend runs them before any engine work.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ferrox.common.errors import InvalidArgumentError, LoRAAdapterError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The largest rank `max_lora_rank` may allow.
MAX_SUPPORTED_RANK = 256
# A safetensors header larger than this is not an adapter's.
MAX_HEADER_BYTES = 64 << 20
_TENSOR = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"([a-z_]+)\.lora_([AB])\.weight$"
)
# PEFT options whose meaning ferrox does not implement: a config that sets
# one is refused rather than served with a different meaning.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "fan_in_fan_out": "fan_in_fan_out weights (GPT-2-style Conv1D layers)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_pattern": "layers_pattern",
    "trainable_token_indices": "trainable token embeddings",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
}


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The adapter a request runs under. `lora_int_id`: a positive id the
    caller keeps unique per adapter; `lora_path`: its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise LoRAAdapterError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise LoRAAdapterError("lora_name must not be empty")
        if not self.lora_path:
            raise LoRAAdapterError(f"adapter {self.lora_name!r} has no lora_path")


@dataclass(frozen=True)
class LoraTargets:
    """What an adapter may target in a model: the number of decoder layers
    and, per module name (q_proj, ..., down_proj), its whole (unsharded)
    (in_features, out_features)."""

    num_layers: int
    modules: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, the scale of its delta, and per tensor
    name the (layer, module, "A" or "B") it holds."""

    path: Path
    rank: int
    scale: float
    modules: frozenset[str]
    tensors: dict[str, tuple[int, str, str]]


def _safetensors_header(path: Path) -> dict[str, dict]:
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise LoRAAdapterError(f"{path} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                raise LoRAAdapterError(f"{path} has a {size}-byte header: not an adapter")
            header = json.loads(f.read(size))
    except OSError as e:
        raise LoRAAdapterError(f"cannot read {path}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{path} has no valid safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path} has no valid safetensors header")
    header.pop("__metadata__", None)
    return header


def _config(directory: Path) -> dict:
    path = directory / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise LoRAAdapterError(f"the adapter directory {directory} has no {ADAPTER_CONFIG}") from e
    except OSError as e:
        raise LoRAAdapterError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise LoRAAdapterError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{path} is not a JSON object")
    return config


def _scale(config: dict, rank: int) -> float:
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAAdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_adapter(path: str | Path, targets: LoraTargets, max_rank: int) -> AdapterSpec:
    """Checks the adapter directory at `path` against the model's targets:
    the config's kind and options, every tensor's name, layer, module and
    shape, one A and one B per adapted module, the rank at most `max_rank`."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"the adapter path {str(path)!r} is not a directory")
    config = _config(directory)
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAAdapterError(f"this adapter uses {what}, which ferrox does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias={config.get('bias')!r}: only adapters without biases")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"the adapter's rank r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"the adapter's rank {rank} exceeds max_lora_rank={max_rank}; start the engine "
            "with a larger max_lora_rank"
        )
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise LoRAAdapterError(
            f"the adapter directory {directory} has no {ADAPTER_WEIGHTS} (.bin adapters are "
            "not read: convert them to safetensors)"
        )
    tensors: dict[str, tuple[int, str, str]] = {}
    shapes: dict[tuple[int, str, str], list[int]] = {}
    for name, info in _safetensors_header(weights).items():
        m = _TENSOR.match(name)
        if m is None:
            raise LoRAAdapterError(f"the adapter tensor {name!r} targets no module ferrox adapts")
        layer, module, part = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets.modules:
            raise LoRAAdapterError(
                f"the adapter targets {module!r}, which this model lacks or does not adapt "
                f"(it adapts {sorted(targets.modules)})"
            )
        if layer >= targets.num_layers:
            raise LoRAAdapterError(
                f"the adapter has layer {layer}; this model has {targets.num_layers} layers"
            )
        shape = info.get("shape") if isinstance(info, dict) else None
        fan_in, fan_out = targets.modules[module]
        want = [rank, fan_in] if part == "A" else [fan_out, rank]
        if shape != want:
            raise LoRAAdapterError(
                f"the adapter tensor {name} has shape {shape}, but this model needs {want} "
                "(an adapter trained for another base model?)"
            )
        tensors[name] = (layer, module, part)
        shapes[(layer, module, part)] = shape
    pairs = {(layer, module) for layer, module, _ in shapes}
    for layer, module in sorted(pairs):
        if (layer, module, "A") not in shapes or (layer, module, "B") not in shapes:
            raise LoRAAdapterError(f"layer {layer}'s {module} has lora_A or lora_B, not both")
    if not pairs:
        raise LoRAAdapterError(f"the adapter at {directory} holds no LoRA tensor")
    return AdapterSpec(
        path=directory,
        rank=rank,
        scale=_scale(config, rank),
        modules=frozenset(module for _, module in pairs),
        tensors=tensors,
    )


def check_lora_options(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise InvalidArgumentError(f"max_loras must be a positive int, got {max_loras!r}")
    if (
        isinstance(max_lora_rank, bool)
        or not isinstance(max_lora_rank, int)
        or not 1 <= max_lora_rank <= MAX_SUPPORTED_RANK
    ):
        raise InvalidArgumentError(
            f"max_lora_rank must be an int in [1, {MAX_SUPPORTED_RANK}], got {max_lora_rank!r}"
        )
    if max_cpu_loras is not None and (
        isinstance(max_cpu_loras, bool)
        or not isinstance(max_cpu_loras, int)
        or max_cpu_loras < max_loras
    ):
        raise InvalidArgumentError(
            f"max_cpu_loras must be an int >= max_loras ({max_loras}), got {max_cpu_loras!r}"
        )
