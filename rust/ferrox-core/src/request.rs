//! One request's state inside the scheduler.

use crate::block_allocator::BlockId;
use crate::radix_cache::NodeHandle;
use crate::speculation::SpecState;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Lower values are served first under the priority policy.
    pub priority: i32,
    /// Whether admission may reuse cached prefix blocks (a request that
    /// needs every prompt position computed, e.g. for prompt logprobs, opts
    /// out; its blocks are still shared with later requests).
    pub use_prefix_cache: bool,
    /// The LoRA adapter the request runs under (0: the base model). It is
    /// also the request's prefix-cache namespace: KV computed under one
    /// adapter never serves another.
    pub adapter: u32,
    /// Prompt ranges `[start, end)` a prefill chunk never ends inside
    /// (sorted, disjoint): an image whose tokens attend to each other in
    /// both directions is computed in one chunk. A chunk may start inside
    /// one (a prefix-cache hit, whose cached part is valid) and then runs
    /// to its end.
    pub atomic_spans: Vec<(usize, usize)>,
    /// Prompt ranges `[start, end)` whose rows an encoder computes when a
    /// chunk first reaches them (sorted, disjoint): each costs its length
    /// of the step's `max_encoder_tokens_per_step`.
    pub encoder_spans: Vec<(usize, usize)>,
}

impl Default for RequestParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            min_tokens: 0,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            priority: 0,
            use_prefix_cache: true,
            adapter: 0,
            atomic_spans: Vec::new(),
            encoder_spans: Vec::new(),
        }
    }
}

/// Why a request ended; `None` in arrays is encoded as 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string found by the caller.
    Stop = 1,
    /// `max_tokens` or `max_model_len` reached.
    Length = 2,
    Abort = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: u64,
    pub arrival: u64,
    pub params: RequestParams,
    pub status: RequestStatus,
    /// Prompt followed by the output tokens.
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is in `block_table` (the last sampled token is not).
    pub num_computed_tokens: usize,
    pub block_table: Vec<BlockId>,
    /// The sliding-window pool's blocks of the same positions (NULL_BLOCK
    /// behind the window); empty without a window pool.
    pub window_table: Vec<BlockId>,
    /// Entries of `window_table` before this one are all NULL_BLOCK.
    pub window_start: usize,
    /// The recurrent-state slot it holds while it runs (a model with
    /// recurrent state; see `SchedulerConfig::num_state_slots`).
    pub state_slot: Option<u32>,
    /// With state snapshots: the block boundaries (ascending, past the
    /// computed tokens) after which its state is saved for the prefix
    /// cache; a prefill chunk ends at the next one.
    pub snapshot_boundaries: Vec<usize>,
    /// Of the outstanding step: the snapshots it writes, each with the
    /// boundary it holds the state after, and the snapshot its state slot
    /// starts from (a prefix-cache hit).
    pub pending_saves: Vec<(u32, usize)>,
    pub restore_from: Option<u32>,
    /// Of the outstanding step, after a prefix-cache hit: a cached block
    /// whose first `n` positions hold the KV of this request's next `n`
    /// tokens (a block that begins as the request's next one does), copied
    /// into the request's own block before the step instead of computed.
    pub kv_copy: Option<(BlockId, usize)>,
    /// The radix-cache node this request locks (the prefix it shares).
    pub cache_handle: Option<NodeHandle>,
    /// Leading blocks of `block_table` that are the cache's blocks.
    pub num_shared_blocks: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    pub num_prefix_hit_tokens: usize,
    pub num_preemptions: u32,
    /// Set on preemption: output length at that moment; the request is not
    /// preempted again before it has produced a token past it.
    pub protected_until: Option<usize>,
    /// Steps this request has waited for another request to compute the
    /// prefix they share (bounded: see `scheduler::MAX_PREFIX_WAIT_STEPS`).
    pub num_prefix_wait_steps: u32,
    /// Steps this request was passed over because `max_adapters` other
    /// adapters were running (bounded: see `scheduler::MAX_ADAPTER_WAIT_STEPS`).
    pub num_adapter_wait_steps: u32,
    /// The scheduler step at which it was queued (added or preempted): the
    /// longest-prefix-match policy serves it first once it has waited long.
    pub queued_at_step: u64,
    /// Draft tokens of the outstanding plan (empty outside a step).
    pub draft: Vec<u32>,
    pub spec: SpecState,
}

impl Request {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }
    pub fn num_pending_tokens(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }
    /// A chunk of `num_tokens` from `start`, cut so that it does not end
    /// inside an atomic span (to the span's start; 0 when the chunk starts
    /// at or inside it and cannot reach its end).
    pub fn outside_atomic_spans(&self, start: usize, num_tokens: usize) -> usize {
        let end = start + num_tokens;
        let spans = &self.params.atomic_spans;
        let i = spans.partition_point(|&(_, e)| e <= end);
        match spans.get(i) {
            Some(&(s, _)) if s < end => s.saturating_sub(start),
            _ => num_tokens,
        }
    }
    /// A chunk of `num_tokens` from `start`, cut before the first encoder
    /// span it starts that would take the step's encoder tokens (`spent`
    /// so far) past `budget` (0: unbounded; the step's first span always
    /// fits), and the encoder tokens the cut chunk starts.
    pub fn within_encoder_budget(
        &self,
        start: usize,
        num_tokens: usize,
        spent: usize,
        budget: usize,
    ) -> (usize, usize) {
        let end = start + num_tokens;
        let spans = &self.params.encoder_spans;
        let first = spans.partition_point(|&(s, _)| s < start);
        let mut cost = 0;
        for &(s, e) in spans[first..].iter().take_while(|&&(s, _)| s < end) {
            let used = spent + cost;
            if budget > 0 && used > 0 && used + (e - s) > budget {
                return (s - start, cost);
            }
            cost += e - s;
        }
        (num_tokens, cost)
    }
    pub fn is_protected(&self) -> bool {
        matches!(self.protected_until, Some(len) if self.num_output_tokens() <= len)
    }
}
