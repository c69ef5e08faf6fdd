//! The flat arrays one step hands to the model runner, and the compact events
//! `update` hands back.

/// One step's work: B requests, T tokens, S sampled positions. Rows with one
/// scheduled token (decodes) come first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchPlan {
    pub step_id: u64,
    /// [B]
    pub req_ids: Vec<u64>,
    /// [B] tokens computed in this step for each request.
    pub num_scheduled_tokens: Vec<i32>,
    /// [B] tokens already in the KV cache before this step.
    pub num_computed_tokens: Vec<i32>,
    /// Rows [0, num_decodes) schedule exactly one token.
    pub num_decodes: usize,
    /// [B] draft tokens each row verifies (its last positions): such a row
    /// samples all of its `1 + d` positions.
    pub num_draft_tokens: Vec<i32>,
    /// Draft tokens in total.
    pub num_drafts_total: usize,
    /// [T]
    pub input_ids: Vec<i64>,
    /// [T]
    pub positions: Vec<i64>,
    /// [B + 1] prefix sums of `num_scheduled_tokens`.
    pub query_start_loc: Vec<i32>,
    /// [B] context length after this step.
    pub seq_lens: Vec<i32>,
    /// [B] the LoRA adapter each row runs under (0: the base model).
    pub adapters: Vec<u32>,
    /// [B, block_table_width], row-major, padded with 0.
    pub block_table: Vec<i32>,
    pub block_table_width: usize,
    /// [T] KV slot of each token: block * block_size + offset.
    pub slot_mapping: Vec<i64>,
    /// With a sliding-window pool (else empty): the window tables [B,
    /// block_table_width] (0 for a block behind the window, which is never
    /// read) and each token's slot in that pool [T].
    pub window_block_table: Vec<i32>,
    pub window_slot_mapping: Vec<i64>,
    /// With recurrent state (else empty): [B] each row's state slot. A row
    /// with no computed tokens starts from a zero state; any other row
    /// continues the state its slot holds.
    pub state_slots: Vec<i32>,
    /// With state snapshots: (snapshot, state slot) pairs, flat: the slots
    /// to fill from snapshots before the step (prefix-cache hits), and
    /// (state slot, snapshot) pairs: the snapshots to write from slots after
    /// it (each slot then holds the state after a block boundary).
    pub state_restores: Vec<i32>,
    pub state_saves: Vec<i32>,
    /// KV slots to copy before the step, in pairs at the same index (all
    /// read before any is written): a prefix-cache hit's positions whose KV
    /// a cached block holds although the block as a whole does not match
    /// (see `Request::kv_copy`). Full-attention pool only.
    pub kv_copy_src: Vec<i64>,
    pub kv_copy_dst: Vec<i64>,
    /// [S] token indices whose logits are sampled.
    pub logits_indices: Vec<i64>,
    /// [S] row of each sampled position.
    pub sample_rows: Vec<i32>,
    /// Requests preempted by this step (they wait to be recomputed).
    pub preempted_ids: Vec<u64>,
    /// Requests aborted since the previous step.
    pub aborted_ids: Vec<u64>,
    /// Slot of each row inside the scheduler (private bookkeeping).
    pub(crate) slots: Vec<usize>,
    /// The drafts the scheduler proposed (n-gram), rows in order; the
    /// caller's drafts replace them in `update` (a draft model).
    pub(crate) draft_tokens: Vec<u32>,
}

impl BatchPlan {
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.req_ids.is_empty()
    }
}

/// What `update` reports: one entry per token a request gained (several for
/// a request whose drafts were accepted), or per request that finished
/// without one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepEvents {
    pub req_ids: Vec<u64>,
    /// The new token, or -1 for a request finished without one.
    pub token_ids: Vec<i64>,
    /// 0 while running, else `FinishReason as u8`.
    pub finish_reasons: Vec<u8>,
    /// One entry per request that verified drafts this step: its id, the
    /// drafts verified and how many were accepted.
    pub verified_ids: Vec<u64>,
    pub num_drafted: Vec<u32>,
    pub num_accepted: Vec<u32>,
}

impl StepEvents {
    pub fn push(&mut self, id: u64, token: Option<u32>, reason: Option<crate::FinishReason>) {
        self.req_ids.push(id);
        self.token_ids.push(token.map_or(-1, i64::from));
        self.finish_reasons.push(reason.map_or(0, |r| r as u8));
    }
    pub fn len(&self) -> usize {
        self.req_ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.req_ids.is_empty()
    }
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_total_blocks: usize,
    pub num_free_blocks: usize,
    /// Blocks referenced by at least one live request.
    pub num_used_blocks: usize,
    /// Blocks held only by the prefix cache (free to evict).
    pub num_cached_blocks: usize,
    /// The sliding-window pool (all 0 without one): its size, its free
    /// blocks, and those only the prefix cache holds.
    pub num_window_blocks: usize,
    pub num_free_window_blocks: usize,
    pub num_cached_window_blocks: usize,
    /// Recurrent-state slots (0 without recurrent state) and those free.
    pub num_state_slots: usize,
    pub num_free_state_slots: usize,
    /// State snapshots (0 without) and those the prefix cache holds.
    pub num_state_snapshots: usize,
    pub num_cached_state_snapshots: usize,
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub num_preemptions: u64,
    pub spec: crate::speculation::SpecStats,
}
