"""The LoRA adapters an engine has loaded, and who uses them.

A request names its adapter by a `LoRARequest`; the first request of an
adapter loads it (the runner checks and installs its weights) under an
internal id, which the scheduler also uses as the request's prefix-cache
namespace. An adapter stays loaded while unfinished requests use it; of those
no request uses, the `max_cpu_loras` most recently used are kept for later
requests and older ones are dropped. An adapter loaded again after it was
dropped gets a new internal id, so KV computed under its earlier weights is
never reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from ferrox.common.errors import InvalidArgumentError, LoRAAdapterError
from ferrox.common.lora import LoRARequest


class AdapterRunner(Protocol):
    def add_adapter(self, adapter: int, path: str) -> None: ...
    def remove_adapter(self, adapter: int) -> None: ...


@dataclass
class _Loaded:
    internal: int
    request: LoRARequest
    users: int = 0


class AdapterRegistry:
    def __init__(self, runner: AdapterRunner, keep_idle: int) -> None:
        self._runner = runner
        self._keep_idle = keep_idle
        self._by_id: dict[int, _Loaded] = {}
        self._by_internal: dict[int, _Loaded] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # user ids, oldest first
        self._next_internal = 1

    def acquire(self, lora: LoRARequest) -> int:
        """The adapter's internal id, loading it if needed; one more user."""
        loaded = self._by_id.get(lora.lora_int_id)
        if loaded is not None and loaded.request.lora_path != lora.lora_path:
            raise LoRAAdapterError(
                f"lora_int_id {lora.lora_int_id} is loaded from {loaded.request.lora_path!r}, "
                f"not {lora.lora_path!r}: give each adapter its own id"
            )
        if loaded is None:
            internal = self._next_internal
            self._runner.add_adapter(internal, lora.lora_path)
            self._next_internal += 1
            loaded = self._by_id[lora.lora_int_id] = self._by_internal[internal] = _Loaded(
                internal, lora
            )
        loaded.users += 1
        self._idle.pop(lora.lora_int_id, None)
        self._trim()
        return loaded.internal

    def release(self, internal: int) -> None:
        """One user of the adapter is done."""
        loaded = self._by_internal[internal]
        if loaded.users <= 0:
            raise InvalidArgumentError(f"adapter {internal} has no user to release")
        loaded.users -= 1
        if loaded.users == 0:
            self._idle[loaded.request.lora_int_id] = None
            self._trim()

    def unload(self, lora_name: str) -> bool:
        """Drops an adapter no request uses; False for one not loaded."""
        for user_id, loaded in self._by_id.items():
            if loaded.request.lora_name == lora_name:
                if loaded.users:
                    raise LoRAAdapterError(
                        f"adapter {lora_name!r} is in use by {loaded.users} request(s)"
                    )
                self._drop(user_id)
                return True
        return False

    def num_users(self) -> dict[str, int]:
        """Users per loaded adapter, by name."""
        return {x.request.lora_name: x.users for x in self._by_id.values()}

    def _trim(self) -> None:
        while len(self._idle) > self._keep_idle:
            user_id, _ = self._idle.popitem(last=False)
            self._drop(user_id)

    def _drop(self, user_id: int) -> None:
        loaded = self._by_id.pop(user_id)
        del self._by_internal[loaded.internal]
        self._idle.pop(user_id, None)
        self._runner.remove_adapter(loaded.internal)
