"""ModelRunner: turns a BatchPlan into tensors (one flat, unpadded batch of
prefill chunks and decodes), runs the model, gathers logits only where the
plan samples, and samples."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrox._native import BatchPlan
from ferrox.common.config import (
    CPU_KV_CACHE_MAX_BYTES,
    CPU_KV_CACHE_MIN_BYTES,
    CPU_KV_CACHE_TOKENS,
    CPU_KV_CACHE_TOKENS_PER_SEQ,
    EngineConfig,
)
from ferrox.common.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.common.lora import read_adapter
from ferrox.common.multimodal import StepImages
from ferrox.common.runtime import release_freed_memory
from ferrox.layers.attention import AttentionMetadata
from ferrox.layers.attention.cpu_backend import CpuAttentionBackend
from ferrox.layers.lora import LoraModel, LoraStep
from ferrox.layers.quant_linear import QuantLinear
from ferrox.loader.lora import load_adapter_tensors
from ferrox.loader.model_loader import LoadedModel
from ferrox.parallel import state as distributed
from ferrox.parallel.device import torch_device, torch_dtype
from ferrox.parallel.step_message import StepPlan
from ferrox.runner.cuda_graph import DecodeGraphs
from ferrox.runner.draft import DraftRunner
from ferrox.runner.encoder_cache import EncoderCache
from ferrox.runner.kv_cache import ModelKV, bytes_per_block, kv_groups
from ferrox.runner.sampler import Sampler
from ferrox.runner.sampling_batch import SamplingBatch

logger = logging.getLogger("ferrox")

# Memory the CUDA graphs' private pool needs beyond their activations.
GRAPH_POOL_OVERHEAD_BYTES = 64 << 20
# The profiling pass: at most this many tokens, in sequences of at most this length.
PROFILE_MAX_TOKENS = 8192
PROFILE_MAX_SEQ_LEN = 2048
# The full pool of a model whose every layer has a sliding window holds no
# memory; its block count (the scheduler's bookkeeping) is bounded by this.
MAX_BOOKKEEPING_BLOCKS = 1 << 22
# Draft tokens a step may add to a request (the scheduler's bound).
MAX_DRAFT_TOKENS = 16
# Pinned staging buffers start at this many elements and grow as steps need.
MIN_STAGING_ELEMENTS = 1024
# On the CPU, a hybrid model's recurrent-state slots take at most this much
# memory (and its snapshots as much again): max_num_seqs slots unless fewer
# fit, admission then waiting for a free one. The pool's pages are mapped as
# slots are first written.
CPU_STATE_POOL_BYTES = 1 << 30


@dataclass
class PromptChunkLogprobs:
    """Logprobs of the prompt tokens a prefill chunk predicts."""

    row: int
    token_logprobs: np.ndarray  # [n] logprob of each next prompt token
    token_ranks: np.ndarray  # [n]
    top_ids: np.ndarray | None  # [n, k]
    top_logprobs: np.ndarray | None  # [n, k]


@dataclass
class RunnerOutput:
    sampled: np.ndarray  # [S] int64
    sampled_logprobs: np.ndarray | None  # [S]
    sampled_ranks: np.ndarray | None  # [S]
    top_ids: np.ndarray | None  # [S, k]
    top_logprobs: np.ndarray | None  # [S, k]
    prompt_logprobs: list[PromptChunkLogprobs]
    # The final hidden states of the pooled sample rows [P, hidden] float32.
    pooled: np.ndarray | None = None

    def row_logprobs(self, i: int, k: int) -> tuple[float, int, list[int], list[float]] | None:
        """Sample row i's (logprob, rank, top-k ids, top-k logprobs), or None
        when no request in the step asked for logprobs."""
        if self.sampled_logprobs is None or self.sampled_ranks is None:
            return None
        top_ids: list[int] = []
        top_lps: list[float] = []
        if k and self.top_ids is not None and self.top_logprobs is not None:
            top_ids, top_lps = self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()
        return float(self.sampled_logprobs[i]), int(self.sampled_ranks[i]), top_ids, top_lps


def kv_cache_dtype(config: EngineConfig, model: torch.nn.Module) -> torch.dtype:
    """The KV cache's dtype (see config.KV_CACHE_DTYPES): "auto" is the
    model's, except float16 on the CPU under block-format linear layers
    (the same perplexity on the bundled model, half the memory:
    `benches/quant_quality.py`, `benches/vs_llamacpp.py`)."""
    if config.kv_cache_dtype != "auto":
        return getattr(torch, config.kv_cache_dtype)  # type: ignore[no-any-return]
    blocks = any(isinstance(m, QuantLinear) for m in model.modules())
    if torch_device(config).type == "cpu" and torch_dtype(config) == torch.float32 and blocks:
        return torch.float16
    return torch_dtype(config)


def ssm_state_dtype(config: EngineConfig) -> torch.dtype:
    """What the state pool keeps linear-attention layers' recurrent matrices
    in (see config.MAMBA_SSM_CACHE_DTYPES)."""
    return torch.bfloat16 if config.mamba_ssm_cache_dtype == "bfloat16" else torch.float32


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        max_model_len: int,
        draft: LoadedModel | None = None,
    ) -> None:
        """`draft`: the draft model of speculative decoding, whose KV cache
        shares the target's block layout (and its memory budget)."""
        self.config = config
        self.model = loaded.model
        self.device = torch_device(config)
        self.dtype = torch_dtype(config)
        self.kv_dtype = kv_cache_dtype(config, self.model)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise InvalidArgumentError(
                f"kv_cache_dtype={config.kv_cache_dtype!r} with a {self.dtype} model runs on the "
                "CPU only (on a GPU the cache has the model's dtype)"
            )
        hf = loaded.hf_config
        self.vocab_size = int(hf.vocab_size)
        self.max_model_len = max_model_len
        self.kv_groups = groups = kv_groups(self.model, ssm_state_dtype(config))
        if config.mamba_ssm_cache_dtype != "auto" and not groups.state_layers:
            raise InvalidArgumentError(
                f"mamba_ssm_cache_dtype={config.mamba_ssm_cache_dtype!r} is for models with "
                "linear-attention layers (Qwen3.5, Qwen3-Next); this model has none"
            )
        self.num_layers = len(groups.full_layers) + len(groups.window_layers)
        self.num_kv_heads, self.head_dim = groups.num_kv_heads, groups.head_dim
        if draft is not None and not self.kv_groups.full_layers:
            raise InvalidArgumentError(
                "a draft model needs a target with full-attention layers (its KV follows their "
                "block tables); this model's every layer has a sliding window: use "
                "method='ngram' speculation"
            )
        self.draft = (
            None
            if draft is None
            else DraftRunner(draft, config.block_size, self.kv_dtype, self.device)
        )
        if groups.state_layers and draft is not None:
            raise UnsupportedModelError(
                "speculative decoding is not supported for a model with linear-attention layers "
                "(their recurrent state cannot roll back rejected drafts)"
            )
        # One recurrent-state slot per sequence that may run (on the CPU
        # within CPU_STATE_POOL_BYTES), and as many snapshots for the prefix
        # cache.
        self.num_state_slots = config.max_num_seqs if groups.state_layers else 0
        if groups.state_layers and self.device.type == "cpu":
            fit = max(1, CPU_STATE_POOL_BYTES // groups.state_bytes)
            self.num_state_slots = min(self.num_state_slots, fit)
        if groups.state_layers:
            logger.info(
                "recurrent state: %d slots of %.1f MiB (one sequence's state in all %d "
                "linear-attention layers)",
                self.num_state_slots,
                groups.state_bytes / 2**20,
                len(groups.state_layers),
            )
        caching = config.enable_prefix_caching
        self.num_state_snapshots = self.num_state_slots if caching else 0
        num_blocks, num_window_blocks = self._num_kv_blocks()
        # Loading's freed temporaries go back to the system before the cache
        # is allocated (its pages then cost memory only once written).
        release_freed_memory()
        self.kv_cache = ModelKV(
            self.kv_groups,
            num_blocks,
            num_window_blocks,
            config.block_size,
            self.kv_dtype,
            self.device,
            zeroed=not self._reads_written_slots_only(),
            num_state_slots=self.num_state_slots,
            num_state_snapshots=self.num_state_snapshots,
        )
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        self.sampler = Sampler()
        self.encoder_cache = EncoderCache(config.mm_encoder_cache_tokens)
        self._staging: dict[str, torch.Tensor] = {}
        self.lora = self._attach_lora() if config.enable_lora else None
        self.graphs: DecodeGraphs | None = None
        backend = self.model.attention_backend
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and backend.supports_cuda_graphs
            and self.model.supports_cuda_graphs
        ):
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache.layers,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                vocab_size=self.vocab_size,
                block_size=config.block_size,
                device=self.device,
            )
            self.graphs.capture()

    def _attach_lora(self) -> LoraModel:
        model = self.model
        if not model.supports_lora:
            raise UnsupportedModelError(
                f"LoRA adapters do not run on {type(model).__name__} yet; they run on the "
                "Llama, Mistral, Qwen2 and Qwen3 families"
            )
        if self.device.type == "cpu":
            mode = "native" if self.dtype == torch.float32 else "torch"
        else:
            mode = "stacked"  # the Triton kernels (not yet run on a GPU)
        sites = model.lora_sites()
        max_rank = self.config.max_lora_rank
        targets = model.lora_targets()
        return LoraModel(
            model, targets, sites, mode, model.shard_of, max_rank, self.dtype, self.device
        )

    def add_adapter(self, adapter: int, path: str) -> None:
        """Loads the adapter at `path` (checked again: the files may have
        changed since the caller's check) under id `adapter`."""
        if self.lora is None:
            raise InvalidArgumentError("this engine serves no LoRA adapters (enable_lora)")
        spec = read_adapter(path, self.lora.targets, self.config.max_lora_rank)
        tensors = load_adapter_tensors(spec)
        self.lora.add(adapter, spec, tensors)

    def remove_adapter(self, adapter: int) -> None:
        if self.lora is not None:
            self.lora.remove(adapter)

    def _reads_written_slots_only(self) -> bool:
        """The CPU backend in float32 reads each row's own context, never a
        slot beyond it (other backends gather padded contexts and mask)."""
        backend = self.model.attention_backend
        return isinstance(backend, CpuAttentionBackend) and self.dtype == torch.float32

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_window_blocks(self) -> int:
        """The sliding-window layers' pool (0: the model has none)."""
        return self.kv_cache.num_window_blocks

    @property
    def sliding_window(self) -> int | None:
        return self.kv_groups.sliding_window

    def _num_kv_blocks(self) -> tuple[int, int]:
        """Blocks of the full-attention pool and of the window pool. The
        window pool gets as many blocks as the full one, but never more than
        `max_num_seqs` windows and one step need at once (`_window_blocks_cap`);
        the memory this leaves goes to the full pool."""
        cfg = self.config
        groups = self.kv_groups

        def pool_bytes(layers: list[int]) -> int:
            return bytes_per_block(
                len(layers), cfg.block_size, groups.num_kv_heads, groups.head_dim, self.kv_dtype
            )

        per_full, per_window = pool_bytes(groups.full_layers), pool_bytes(groups.window_layers)
        if self.draft is not None:  # both caches hold every full block
            per_full += self.draft.bytes_per_block()
        per_block = per_full + per_window
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                states = self.num_state_slots + self.num_state_snapshots
                budget = self._free_gpu_budget() - states * groups.state_bytes
            else:
                # Sized from the model and the batch (config.py): a tiny
                # model gets the floor's many more tokens, a large one the
                # ceiling's fewer.
                tokens = max(CPU_KV_CACHE_TOKENS, self.max_model_len)
                if self._reads_written_slots_only():  # (pages mapped once written)
                    tokens = max(tokens, cfg.max_num_seqs * CPU_KV_CACHE_TOKENS_PER_SEQ)
                budget = max(tokens // cfg.block_size * per_block, CPU_KV_CACHE_MIN_BYTES)
                budget = min(budget, CPU_KV_CACHE_MAX_BYTES)
            num_blocks = budget // per_block
            if groups.window_layers:
                cap = self._window_blocks_cap()
                if not groups.full_layers:
                    num_blocks = budget // per_window  # (all window layers)
                elif num_blocks > cap:
                    num_blocks = (budget - cap * per_window) // per_full
        if distributed.state().size > 1:  # every rank holds every block (of its heads)
            agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        needed = -(-self.max_model_len // cfg.block_size)
        num_window_blocks = 0
        if groups.window_layers:
            num_window_blocks = min(num_blocks, self._window_blocks_cap())
            if not groups.full_layers:
                # No full-attention memory: its tables are bookkeeping only.
                num_window_blocks = num_blocks
                num_blocks = min(cfg.max_num_seqs * needed + num_blocks, MAX_BOOKKEEPING_BLOCKS)
            needed = min(needed, self._window_blocks_cap(max_num_seqs=1))
        have = min(num_blocks, num_window_blocks or num_blocks)
        if have < needed:
            raise InvalidArgumentError(
                f"the KV cache holds {have} blocks of {cfg.block_size} tokens, fewer than "
                f"the {needed} one max_model_len={self.max_model_len} sequence needs; give more "
                "memory (kv_cache_memory_bytes / gpu_memory_utilization) or a smaller max_model_len"
            )
        return num_blocks, num_window_blocks

    def _window_blocks_cap(self, max_num_seqs: int | None = None) -> int:
        """The most window-pool blocks the scheduler can hold for running
        requests at once: each of `max_num_seqs` the blocks behind its next
        position's window and one partial block, plus one step's tokens."""
        cfg = self.config
        max_num_seqs = cfg.max_num_seqs if max_num_seqs is None else max_num_seqs
        window = self.kv_groups.sliding_window or 0
        behind = -(-(window - 1) // cfg.block_size) + 2
        step = cfg.batched_tokens_limit(self.max_model_len) + MAX_DRAFT_TOKENS
        return max_num_seqs * behind + -(-step // cfg.block_size)

    def _free_gpu_budget(self) -> int:
        """Memory left for the KV cache on the GPU after a profiling forward
        pass at the largest step, within `gpu_memory_utilization`."""
        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory other processes hold counts against us too.
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        # CUDA graphs keep the activations of their largest batch alive in a
        # private pool (a share of the profiled activations), and write logits
        # into one static buffer: budget for both.
        graphs = 0
        if not self.config.enforce_eager and self.model.supports_cuda_graphs:
            activations = peak - weights
            graphs = (
                activations * self.config.max_num_seqs // max(num_tokens, 1)
                + DecodeGraphs.logits_bytes(self.config.max_num_seqs, self.vocab_size)
                + GRAPH_POOL_OVERHEAD_BYTES
            )
        budget = (
            int(total * self.config.gpu_memory_utilization) - peak - graphs - max(used_elsewhere, 0)
        )
        return max(budget, 0)

    def profile_run(self) -> int:
        """One forward pass over a full token budget, written into a scratch
        one-block cache, to measure activation memory; returns its tokens."""
        cfg = self.config
        num_tokens = min(cfg.batched_tokens_limit(self.max_model_len), PROFILE_MAX_TOKENS)
        seq = min(num_tokens, PROFILE_MAX_SEQ_LEN)
        rows = -(-num_tokens // seq)
        lens = np.full(rows, seq, dtype=np.int32)
        lens[-1] = num_tokens - seq * (rows - 1)
        stateful = bool(self.kv_groups.state_layers)
        scratch = ModelKV(
            self.kv_groups,
            1,
            1,
            cfg.block_size,
            self.kv_dtype,
            self.device,
            num_state_slots=rows if stateful else 0,
        )
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        meta = AttentionMetadata(
            num_reqs=rows,
            num_decodes=0,
            num_tokens=num_tokens,
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            block_table=torch.zeros(rows, 1, dtype=torch.int32, device=self.device),
            query_start_loc=torch.from_numpy(qsl).to(self.device),
            seq_lens=torch.from_numpy(lens).to(self.device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            num_computed_cpu=np.zeros(rows, dtype=np.int32),
            max_query_len=seq,
            max_seq_len=seq,
        )
        if self.kv_groups.window_layers:
            meta.window = dataclasses.replace(meta, sliding_window=self.sliding_window or 0)
        if stateful:
            meta.state_slots_cpu = np.arange(rows, dtype=np.int64)
            meta.state_slots = torch.from_numpy(meta.state_slots_cpu).to(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(self.device)
        with torch.inference_mode():
            hidden = self.model(ids, positions, scratch.layers, meta)
            self.model.compute_logits(hidden[: cfg.max_num_seqs])
        del scratch
        return num_tokens

    def _tensor(self, array: np.ndarray, name: str = "") -> torch.Tensor:
        """The array on the device: as is on the CPU; through a reusable
        pinned buffer and an asynchronous copy on CUDA (safe to reuse: each
        step ends by synchronising on the sampled tokens)."""
        t = torch.from_numpy(array)
        if self.device.type == "cpu":
            return t
        key = name or str(t.dtype)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), MIN_STAGING_ELEMENTS), dtype=t.dtype).pin_memory()
            self._staging[key] = buf
        staged = buf[: t.numel()].view(t.shape)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def build_metadata(self, plan: BatchPlan | StepPlan) -> AttentionMetadata:
        qsl = plan.query_start_loc
        seq_lens = plan.seq_lens
        num_sched = plan.num_scheduled_tokens
        meta = AttentionMetadata(
            num_reqs=plan.num_reqs,
            num_decodes=plan.num_decodes,
            num_tokens=plan.num_tokens,
            slot_mapping=self._tensor(plan.slot_mapping, "slots"),
            block_table=self._tensor(plan.block_table, "blocks"),
            block_table_cpu=plan.block_table,
            query_start_loc=self._tensor(qsl, "qsl"),
            seq_lens=self._tensor(seq_lens, "seq_lens"),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_computed_cpu=plan.num_computed_tokens,
            max_query_len=int(num_sched.max()) if len(num_sched) else 0,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
        )
        window_table = plan.window_block_table
        if window_table is not None and plan.window_slot_mapping is not None:
            meta.window = dataclasses.replace(
                meta,
                slot_mapping=self._tensor(plan.window_slot_mapping, "window_slots"),
                block_table=self._tensor(window_table, "window_blocks"),
                block_table_cpu=window_table,
                sliding_window=self.sliding_window or 0,
            )
        if plan.state_slots is not None:
            slots = plan.state_slots.astype(np.int64)
            meta.state_slots_cpu = slots
            meta.state_slots = self._tensor(slots, "state_slots")
        return meta

    @torch.inference_mode()
    def execute(
        self,
        plan: BatchPlan,
        sampling: SamplingBatch,
        prompt_logprob_rows: list[tuple[int, int, int]] | None = None,
        pool_rows: list[int] | None = None,
        images: StepImages | None = None,
    ) -> RunnerOutput:
        """Runs one step. `prompt_logprob_rows` lists (row, num_top, next
        token) for prefill chunks whose prompt logprobs are wanted: each of
        their positions gets logits; `next token` is the prompt token after
        the chunk (-1 when the chunk ends the prompt). `pool_rows`: sample
        rows (embedding requests) whose final hidden state is returned.
        `images`: the rotary positions of a step with image rows and the
        encoder rows its placeholder tokens take."""
        logits, hidden = self._forward(
            plan, prompt_logprob_rows, eager=bool(pool_rows), images=images
        )
        pooled = None
        if pool_rows:
            assert hidden is not None
            at = plan.logits_indices[np.asarray(pool_rows)]
            pooled = self.model.pool(hidden[self._tensor(at, "pool")]).float().cpu().numpy()
        out = self.sampler(logits, sampling)
        prompt = [
            self._prompt_logprobs(hidden, plan, row, k, nxt)
            for row, k, nxt in (prompt_logprob_rows or [])
            if hidden is not None
        ]
        return RunnerOutput(
            sampled=out.sampled.cpu().numpy(),
            sampled_logprobs=_np(out.sampled_logprobs),
            sampled_ranks=_np(out.sampled_ranks),
            top_ids=_np(out.top_ids),
            top_logprobs=_np(out.top_logprobs),
            prompt_logprobs=prompt,
            pooled=pooled,
        )

    def _forward(
        self,
        plan: BatchPlan | StepPlan,
        prompt_logprob_rows: list[tuple[int, int, int]] | None,
        eager: bool = False,
        images: StepImages | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled rows' logits [S, V], and the hidden states [T, hidden]
        (None from a CUDA graph; `eager`: never from one)."""
        meta = self.build_metadata(plan)
        copy_src, copy_dst = plan.kv_copy_src, plan.kv_copy_dst
        if copy_src is not None and copy_dst is not None and len(copy_src):
            # A prefix hit's positions that a cached block shares, copied.
            self.kv_cache.full.copy_slots(copy_src, copy_dst)
        if images is not None and images.spans:
            meta.image_spans = images.spans
            if meta.window is not None:
                meta.window.image_spans = images.spans
        input_ids = self._tensor(plan.input_ids, "ids")
        step_positions = plan.positions if images is None else images.positions
        positions = self._tensor(step_positions, "positions")
        embeds = self._image_embeddings(input_ids, images) if images and images.pieces else None
        lora_step = None
        if self.lora is not None and plan.adapters is not None:
            lora_step = LoraStep.of(plan.adapters, plan.query_start_loc)
        fits = (
            not eager
            and lora_step is None
            and embeds is None
            and self._graph_fits(meta, prompt_logprob_rows)
        )
        graphs = self.graphs if fits else None
        if graphs is not None:
            # A decode-only step samples every row, in order.
            logits = graphs.run(
                input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_table
            )
            return logits, None
        adapters = self.lora.step(lora_step) if self.lora else contextlib.nullcontext()
        state = self.kv_cache.state
        if state is not None and plan.state_restores is not None:
            state.restore(plan.state_restores)  # prefix-cache hits resume from snapshots
        with adapters:
            layers = self.kv_cache.layers
            if embeds is None:
                hidden = self.model(input_ids, positions, layers, meta)  # [T, hidden]
            else:
                hidden = self.model(input_ids, positions, layers, meta, inputs_embeds=embeds)
        if state is not None and plan.state_saves is not None:
            state.save(plan.state_saves)
        logits_indices = self._tensor(plan.logits_indices, "logits")
        return self.model.compute_logits(hidden[logits_indices]), hidden  # [S, V]

    def _image_embeddings(self, input_ids: torch.Tensor, images: StepImages) -> torch.Tensor:
        """The step's input embeddings [T, hidden]: the token lookup, with
        each image piece's encoder rows in its placeholders' place (whose
        ids, the scheduler's hash ids, are outside the vocabulary)."""
        model: Any = self.model
        text = torch.where(input_ids < self.vocab_size, input_ids, 0)
        x = model.embed(text)
        found = self.encoder_cache.features(model, images.pieces, self.device)
        width = max(rows.shape[1] for rows in found.values())
        if width > x.shape[1]:  # rows beyond the embedding (DeepStack's): zeros for text
            x = torch.cat((x, x.new_zeros(x.shape[0], width - x.shape[1])), dim=1)
        for piece in images.pieces:
            rows = found[piece.image.hash][piece.start : piece.start + piece.count]
            x[piece.dst : piece.dst + piece.count] = rows.to(x.dtype)
        return x

    @torch.inference_mode()
    def follow(self, plan: StepPlan, prompt_logprob_rows: list[tuple[int, int, int]]) -> None:
        """A tensor-parallel worker's step: the forward pass and every
        collective rank 0's `execute` runs, in the same order; rank 0 samples."""
        _, hidden = self._forward(plan, prompt_logprob_rows)
        if hidden is None:  # a CUDA graph: no prompt-logprob rows
            return
        for row, _, next_token in prompt_logprob_rows:
            self._prompt_logits(hidden, plan, row, next_token)

    def _graph_fits(
        self, meta: AttentionMetadata, prompt_logprob_rows: list[tuple[int, int, int]] | None
    ) -> bool:
        return (
            self.graphs is not None
            and not prompt_logprob_rows
            and meta.num_decodes == meta.num_reqs
            and meta.num_reqs <= self.graphs.max_batch
            and meta.block_table.shape[1] <= self.graphs.width
        )

    def _prompt_logits(
        self, hidden: torch.Tensor, plan: BatchPlan | StepPlan, row: int, next_token: int
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Logits of a prefill chunk's positions that predict prompt tokens,
        and those tokens."""
        targets = _prompt_targets(plan, row, next_token)
        start = int(plan.query_start_loc[row])
        return self.model.compute_logits(hidden[start : start + len(targets)]), targets

    def _prompt_logprobs(
        self, hidden: torch.Tensor, plan: BatchPlan, row: int, k: int, next_token: int
    ) -> PromptChunkLogprobs:
        logits, targets = self._prompt_logits(hidden, plan, row, next_token)
        next_ids = torch.from_numpy(np.ascontiguousarray(targets)).to(self.device)
        logprobs = torch.log_softmax(logits, dim=-1)
        token_lp = logprobs.gather(1, next_ids[:, None]).squeeze(1)  # [n]
        ranks = (logprobs > token_lp[:, None]).sum(dim=-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return PromptChunkLogprobs(
            row, token_lp.cpu().numpy(), ranks.cpu().numpy(), _np(top_ids), _np(top_lp)
        )


def _prompt_targets(plan: BatchPlan | StepPlan, row: int, next_token: int) -> np.ndarray:
    """Position p predicts the token at p + 1: the chunk's own next tokens,
    then the prompt token after the chunk, if any."""
    qsl = plan.query_start_loc
    chunk = plan.input_ids[int(qsl[row]) : int(qsl[row + 1])]
    return chunk[1:] if next_token < 0 else np.append(chunk[1:], next_token)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()
