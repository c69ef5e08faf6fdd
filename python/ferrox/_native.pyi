"""Stubs of the Rust core (block allocator, radix prefix cache, scheduler)."""

from collections.abc import Sequence
from typing import Any, TypeAlias, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "BatchPlan",
    "BlockAllocator",
    "CpuDecoderLayer",
    "CpuGatedDeltaLayer",
    "CpuLoraLayer",
    "CpuMoeExperts",
    "RadixCache",
    "Scheduler",
    "SchedulerStats",
    "StepEvents",
    "__version__",
    "add_rms_norm_cpu",
    "apply_token_bitmask_cpu",
    "cpu_isa",
    "dequantize_rows_cpu",
    "gate_rows_cpu",
    "gated_delta_decode_cpu",
    "pack_blocks_cpu",
    "paged_attention_cpu",
    "quant_gated_matmul_cpu",
    "quant_layout_cpu",
    "quant_matmul_cpu",
    "quant_matmul_kernel_cpu",
    "rotary_in_place_cpu",
]

__version__: str

_IdsLike: TypeAlias = npt.NDArray[np.integer[Any]] | Sequence[int]

@final
class BlockAllocator:
    def __new__(cls, num_blocks: int, block_size: int) -> BlockAllocator: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def allocate(self, n: int) -> npt.NDArray[np.uint32]: ...
    def free(self, blocks: _IdsLike) -> None: ...
    def share(self, blocks: _IdsLike) -> None: ...
    def ref_count(self, block: int) -> int: ...
    def check_integrity(self) -> None: ...

@final
class RadixCache:
    def __new__(cls, allocator: BlockAllocator) -> RadixCache: ...
    @property
    def allocator(self) -> BlockAllocator: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def num_locked_blocks(self) -> int: ...
    @property
    def num_queried_tokens(self) -> int: ...
    @property
    def num_hit_tokens(self) -> int: ...
    @property
    def num_evicted_blocks(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    def match_prefix(
        self, tokens: _IdsLike, namespace: int = 0
    ) -> tuple[npt.NDArray[np.uint32], int, int]: ...
    def insert(self, tokens: _IdsLike, blocks: _IdsLike, namespace: int = 0) -> tuple[int, int]: ...
    def lock(self, handle: int) -> None: ...
    def unlock(self, handle: int) -> None: ...
    def evict(self, num_blocks: int) -> int: ...
    def check_integrity(self) -> None: ...

@final
class BatchPlan:
    @property
    def step_id(self) -> int: ...
    @property
    def num_reqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_decodes(self) -> int: ...
    @property
    def num_drafts_total(self) -> int: ...
    @property
    def num_sampled(self) -> int: ...
    @property
    def req_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def adapters(self) -> npt.NDArray[np.uint32]: ...
    @property
    def block_table(self) -> npt.NDArray[np.int32]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def window_block_table(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def window_slot_mapping(self) -> npt.NDArray[np.int64] | None: ...
    @property
    def state_slots(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def state_restores(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def state_saves(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def kv_copy_src(self) -> npt.NDArray[np.int64] | None: ...
    @property
    def kv_copy_dst(self) -> npt.NDArray[np.int64] | None: ...
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def sample_rows(self) -> npt.NDArray[np.int32]: ...
    @property
    def preempted_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def aborted_ids(self) -> npt.NDArray[np.int64]: ...
    def __len__(self) -> int: ...

# Codes of StepEvents.finish_reasons; 0 is "still running".
FINISH_STOP: int
FINISH_LENGTH: int
FINISH_ABORT: int

@final
class SchedulerStats:
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_window_blocks(self) -> int: ...
    @property
    def num_free_window_blocks(self) -> int: ...
    @property
    def num_cached_window_blocks(self) -> int: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def num_free_state_slots(self) -> int: ...
    @property
    def num_state_snapshots(self) -> int: ...
    @property
    def num_cached_state_snapshots(self) -> int: ...
    @property
    def prefix_queried_tokens(self) -> int: ...
    @property
    def prefix_hit_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def spec_num_drafts(self) -> int: ...
    @property
    def spec_num_draft_tokens(self) -> int: ...
    @property
    def spec_num_accepted_tokens(self) -> int: ...
    @property
    def spec_accepted_lengths(self) -> list[int]: ...
    @property
    def spec_accepted_per_position(self) -> list[int]: ...

@final
class StepEvents:
    @property
    def req_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def token_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]: ...
    @property
    def verified_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_drafted(self) -> npt.NDArray[np.uint32]: ...
    @property
    def num_accepted(self) -> npt.NDArray[np.uint32]: ...
    @property
    def stats(self) -> SchedulerStats: ...
    def __len__(self) -> int: ...

@final
class Scheduler:
    def __new__(
        cls,
        *,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        speculative_method: str | None = None,
        num_speculative_tokens: int = 0,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 4,
        spec_adaptive: bool = True,
        spec_disable_by_batch_size: int | None = None,
        sliding_window: int | None = None,
        num_window_blocks: int = 0,
        max_adapters: int = 0,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        max_encoder_tokens_per_step: int = 0,
    ) -> Scheduler: ...
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: _IdsLike,
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        eos_token_ids: _IdsLike | None = None,
        stop_token_ids: _IdsLike | None = None,
        ignore_eos: bool = False,
        priority: int = 0,
        use_prefix_cache: bool = True,
        adapter: int = 0,
        atomic_spans: Sequence[tuple[int, int]] | None = None,
        encoder_spans: Sequence[tuple[int, int]] | None = None,
    ) -> None: ...
    def abort(self, request_id: int) -> bool: ...
    def schedule(self) -> BatchPlan: ...
    def update(
        self,
        plan: BatchPlan,
        sampled_token_ids: _IdsLike,
        finished_externally: _IdsLike | None = None,
        draft_token_ids: _IdsLike | None = None,
    ) -> StepEvents: ...
    def set_spec_cost(
        self, step_seconds: float, token_seconds: float, draft_seconds: float
    ) -> None: ...
    def reset_prefix_cache(self) -> int: ...
    def has_unfinished(self) -> bool: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def num_window_blocks(self) -> int: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def request_info(self, request_id: int) -> dict[str, Any] | None: ...
    def check_integrity(self) -> None: ...

def paged_attention_cpu(
    out: npt.NDArray[np.float32],
    q: npt.NDArray[np.float32],
    k_cache: _KvArray,
    v_cache: _KvArray,
    block_table: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    rows: npt.NDArray[np.int32],
    scale: float,
    num_threads: int,
    window: int = 0,
    sinks: npt.NDArray[np.float32] | None = None,
    batch_invariant: bool = False,
) -> None: ...
def rotary_in_place_cpu(
    x: npt.NDArray[np.float32],
    num_heads: int,
    positions: npt.NDArray[np.int64],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    num_threads: int,
) -> None: ...
def gated_delta_decode_cpu(
    states: _StateArray,
    slots: npt.NDArray[np.int64],
    fresh: npt.NDArray[np.bool_],
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    g: npt.NDArray[np.float32],
    beta: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    num_threads: int,
) -> None: ...
def add_rms_norm_cpu(
    residual: npt.NDArray[np.float32],
    delta: npt.NDArray[np.float32] | None,
    weight: npt.NDArray[np.float32],
    eps: float,
    out: npt.NDArray[np.float32],
    num_threads: int,
) -> None: ...
def apply_token_bitmask_cpu(
    logits: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    bitmask: npt.NDArray[np.int32],
) -> None: ...
def quant_matmul_cpu(
    out: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.uint8],
    bias: npt.NDArray[np.float32] | None,
    fmt: str,
    num_threads: int,
    packed: bool = False,
    batch_invariant: bool = False,
) -> None: ...
def gate_rows_cpu(
    out: npt.NDArray[np.float32],
    gate_up: npt.NDArray[np.float32],
    activation: str,
    num_threads: int,
) -> None: ...
def quant_gated_matmul_cpu(
    out: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.uint8],
    bias: npt.NDArray[np.float32] | None,
    fmt: str,
    activation: str,
    num_threads: int,
    packed: bool = False,
    batch_invariant: bool = False,
) -> None: ...
def quant_matmul_kernel_cpu() -> str: ...
def pack_blocks_cpu(out: npt.NDArray[np.uint8], w: npt.NDArray[np.uint8], fmt: str) -> None: ...
def quant_layout_cpu() -> str: ...
def cpu_isa() -> str: ...
def dequantize_rows_cpu(
    out: npt.NDArray[np.float32],
    w: npt.NDArray[np.uint8],
    fmt: str,
    rows: npt.NDArray[np.int64],
    num_threads: int,
    packed: bool = False,
) -> None: ...

# A KV cache: float32, or float16 viewed as int16 (`tensor.view(torch.int16)`).
_KvArray: TypeAlias = npt.NDArray[np.float32] | npt.NDArray[np.int16]
# a recurrent-state pool: float32, or bfloat16 as its bits
_StateArray: TypeAlias = npt.NDArray[np.float32] | npt.NDArray[np.int16]

# (weight bytes, bias, format, packed): "q8_0" / "q4_1" blocks [N, row bytes]
# (in the kernels' panels if packed), or "f32" for a float32 [N, K] weight
# viewed as uint8 [N, 4 K].
_LayerLinear: TypeAlias = tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32] | None, str, bool]

@final
class CpuDecoderLayer:
    """A decoder layer over block-format or float32 weights, run whole for decode steps."""

    def __new__(
        cls,
        input_norm: npt.NDArray[np.float32],
        post_attention_norm: npt.NDArray[np.float32],
        eps: float,
        qkv: _LayerLinear,
        o: _LayerLinear,
        gate_up: _LayerLinear | None,
        down: _LayerLinear | None,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        head_norms: tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None = None,
        window: int = 0,
        output_norms: tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None = None,
        activation: str = "silu",
        sinks: Sequence[float] | None = None,
        query_gate: bool = False,
        rotary_dim: int | None = None,
    ) -> CpuDecoderLayer: ...
    def forward(
        self,
        residual: npt.NDArray[np.float32],
        x: npt.NDArray[np.float32],
        k_cache: _KvArray,
        v_cache: _KvArray,
        positions: npt.NDArray[np.int64],
        cos: npt.NDArray[np.float32],
        sin: npt.NDArray[np.float32],
        slot_mapping: npt.NDArray[np.int64],
        block_table: npt.NDArray[np.int32],
        query_start_loc: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        num_threads: int,
        batch_invariant: bool = False,
    ) -> None: ...

@final
class CpuGatedDeltaLayer:
    """A hybrid model's linear-attention layer (Gated DeltaNet, then its MLP),
    run whole for decode steps on the state pool."""

    def __new__(
        cls,
        input_norm: npt.NDArray[np.float32],
        post_attention_norm: npt.NDArray[np.float32],
        eps: float,
        qkv: _LayerLinear,
        z: _LayerLinear,
        b: _LayerLinear,
        a: _LayerLinear,
        conv: npt.NDArray[np.float32],
        dt_bias: npt.NDArray[np.float32],
        decay_scale: npt.NDArray[np.float32],
        norm: npt.NDArray[np.float32],
        out: _LayerLinear,
        gate_up: _LayerLinear | None,
        down: _LayerLinear | None,
        key_heads: int,
        value_heads: int,
        k_dim: int,
        v_dim: int,
        tiled: bool,
        activation: str = "silu",
    ) -> CpuGatedDeltaLayer: ...
    def forward(
        self,
        residual: npt.NDArray[np.float32],
        x: npt.NDArray[np.float32],
        conv_states: npt.NDArray[np.float32],
        states: _StateArray,
        slots: npt.NDArray[np.int64],
        fresh: npt.NDArray[np.bool_],
        num_threads: int,
    ) -> None: ...

@final
class CpuMoeExperts:
    """An MoE block (float32 router, block-format experts), run on a few tokens in one call."""

    def __new__(
        cls,
        router: npt.NDArray[np.float32],
        top_k: int,
        renormalize: bool,
        gate_up: list[npt.NDArray[np.uint8]],
        down: list[npt.NDArray[np.uint8]],
        gate_up_fmt: str,
        down_fmt: str,
        hidden: int,
        inter: int,
        router_bias: Sequence[float] | None = None,
        expert_biases: tuple[Sequence[float], Sequence[float]] | None = None,
        clamped_swiglu: tuple[float, float] | None = None,
        packed: bool = False,
    ) -> CpuMoeExperts: ...
    def forward(
        self,
        out: npt.NDArray[np.float32],
        x: npt.NDArray[np.float32],
        num_threads: int,
    ) -> None: ...

@final
class CpuLoraLayer:
    """One linear layer's LoRA adapters, their deltas for a step in one call."""

    def __new__(
        cls, in_features: int, out_features: int, slices: list[tuple[int, int]]
    ) -> CpuLoraLayer: ...
    def add(
        self,
        adapter: int,
        rank: int,
        a: npt.NDArray[np.float32],
        b: list[tuple[int, npt.NDArray[np.float32]]],
    ) -> None: ...
    def remove(self, adapter: int) -> bool: ...
    def apply(
        self,
        x: npt.NDArray[np.float32],
        out: npt.NDArray[np.float32],
        token_adapters: npt.NDArray[np.uint32],
        num_threads: int,
    ) -> None: ...
