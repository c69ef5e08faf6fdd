"""The LoRA adapters a server serves, by the `model` name requests give.

`--lora-modules name=path ...` (or vLLM's JSON form, '{"name": ..., "path":
..., "base_model_name": ...}') names adapters at start-up; each is checked
against the model once the engine reports what it adapts. With
`--allow-runtime-lora-updating`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` add and drop adapters while the server runs; a
runtime path must lie inside `--lora-dir` (after symlinks are resolved).
An adapter that requests still use is not unloaded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ferrox.common.lora import LoRARequest, LoraTargets, read_adapter
from ferrox.server import openai_protocol as op
from ferrox.server.error_responses import error_response, exception_response


class LoadAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


def parse_lora_module(text: str) -> LoRARequest:
    """`name=path`, or a JSON object with name, path and base_model_name
    (the argparse type of --lora-modules; ids are given by `ServerAdapters`)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {e}") from e
        if not isinstance(spec, dict) or not {"name", "path"} <= set(spec):
            raise ValueError(f"--lora-modules: {text!r} needs 'name' and 'path'")
        name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules takes name=path (or JSON), got {text!r}")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules: {text!r} needs a non-empty name and path")
    return LoRARequest(name, 1, path, base)


@dataclass
class ServerAdapters:
    """Adapters by name. `targets` comes from the engine (`Ready`) before
    the first request; until then nothing is checked."""

    max_rank: int = 16
    runtime_updates: bool = False
    lora_dir: Path | None = None
    by_name: dict[str, LoRARequest] = field(default_factory=dict)
    targets: LoraTargets | None = None
    _next_id: int = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.by_name:
            raise op.BadRequest(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
        if self.targets is not None:
            read_adapter(path, self.targets, self.max_rank)
        request = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        self.by_name[name] = request
        return request

    def check_all(self) -> None:
        """Every start-up adapter against the model (ValueError naming it)."""
        assert self.targets is not None
        for name, request in self.by_name.items():
            try:
                read_adapter(request.lora_path, self.targets, self.max_rank)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}: {e}") from e

    def confined(self, path: str) -> str:
        """A runtime path, resolved, if it lies inside --lora-dir."""
        if self.lora_dir is None:
            raise op.BadRequest("runtime adapters need --lora-dir", param="lora_path")
        root = self.lora_dir.resolve()
        resolved = (root / path).resolve()
        if not resolved.is_relative_to(root):
            raise op.BadRequest(
                f"the adapter path {path!r} lies outside --lora-dir", param="lora_path"
            )
        return str(resolved)


class AdapterRoutes:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter. `decode(body,
    kind)`: the server's request decoding (its 400s); `in_use(name)`: the
    requests in flight under an adapter; `unload(name)` tells the engines to
    drop it. Their bodies take no field beyond those declared."""

    def __init__(
        self,
        adapters: ServerAdapters,
        decode: Callable[[bytes, type[Any]], Any],
        in_use: Callable[[str], int],
        unload: Callable[[str], None],
    ) -> None:
        self.adapters = adapters
        self.decode = decode
        self.in_use = in_use
        self.unload_in_engines = unload

    def _refuse_without_flag(self) -> Response | None:
        if self.adapters.runtime_updates:
            return None
        return error_response(
            400,
            "runtime LoRA updates are off: start the server with --allow-runtime-lora-updating "
            "and --lora-dir",
            code="runtime_lora_updating_disabled",
        )

    async def load(self, http: Request) -> Response:
        if (refused := self._refuse_without_flag()) is not None:
            return refused
        try:
            req = self.decode(await http.body(), LoadAdapterRequest)
            if req.load_inplace:
                raise op.BadRequest("load_inplace is not supported", param="load_inplace")
            if not req.lora_name:
                raise op.BadRequest("lora_name must not be empty", param="lora_name")
            path = self.adapters.confined(req.lora_path)
            # (file reads, off the event loop)
            await asyncio.to_thread(self.adapters.add, req.lora_name, path)
        except Exception as e:
            return exception_response(e)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(self, http: Request) -> Response:
        if (refused := self._refuse_without_flag()) is not None:
            return refused
        try:
            req = self.decode(await http.body(), UnloadAdapterRequest)
            request = self.adapters.by_name.get(req.lora_name)
            if request is None:
                return error_response(
                    404, f"the LoRA adapter {req.lora_name!r} is not loaded", code="not_found"
                )
            if (users := self.in_use(req.lora_name)) > 0:
                raise op.BadRequest(
                    f"the LoRA adapter {req.lora_name!r} is in use by {users} request(s)",
                    param="lora_name",
                )
            del self.adapters.by_name[req.lora_name]
            self.unload_in_engines(req.lora_name)
        except Exception as e:
            return exception_response(e)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
