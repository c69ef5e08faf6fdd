//! Scheduler configuration, validated once at construction.

use crate::error::{CoreError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served (priorities are ignored).
    Fcfs,
    /// Lower `priority` value first, then first come, first served.
    Priority,
    /// Longest prefix match: the waiting requests with the most prompt
    /// tokens in the prefix cache first (a request the cache cannot serve
    /// waits while others reuse what it holds), then first come, first
    /// served. Bounded: a request that has waited
    /// `scheduler::LPM_MAX_WAIT_STEPS` steps, or was preempted, goes ahead
    /// of every match; past `scheduler::LPM_MAX_CANDIDATES` waiting
    /// requests the rest keep their arrival order.
    Lpm,
}

impl std::str::FromStr for Policy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            "lpm" => Ok(Policy::Lpm),
            other => Err(CoreError::InvalidArgument(format!(
                "policy must be 'fcfs', 'priority' or 'lpm', got {other:?}"
            ))),
        }
    }
}

/// Where a request's draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: the continuation of the latest earlier occurrence of
    /// the request's last n tokens (n from `max` down to `min`), in Rust.
    Ngram { min: usize, max: usize },
    /// The caller fills the reserved draft positions (a draft model) and
    /// hands the drafts to `update`.
    External,
}

/// The most draft tokens one request may verify in a step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// The most draft tokens per request and step.
    pub num_tokens: usize,
    /// Choose each request's draft length from its measured acceptance and
    /// the step's cost; otherwise always propose `num_tokens`.
    pub adaptive: bool,
    /// No speculation in a step when more requests than this are running.
    pub disable_by_batch_size: Option<usize>,
}

impl SpecConfig {
    pub fn validate(&self) -> Result<()> {
        if self.num_tokens == 0 || self.num_tokens > MAX_SPECULATIVE_TOKENS {
            return Err(CoreError::InvalidArgument(format!(
                "num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {}",
                self.num_tokens
            )));
        }
        if let SpecMethod::Ngram { min, max } = self.method {
            if min == 0 || min > max {
                return Err(CoreError::InvalidArgument(format!(
                    "prompt_lookup_min ({min}) must be at least 1 and at most \
                     prompt_lookup_max ({max})"
                )));
            }
        }
        if self.disable_by_batch_size == Some(0) {
            return Err(CoreError::InvalidArgument(
                "disable_by_batch_size must be positive".into(),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub enable_prefix_caching: bool,
    pub enable_chunked_prefill: bool,
    pub policy: Policy,
    /// Speculative decoding (None: off).
    pub speculation: Option<SpecConfig>,
    /// Layers that attend over the last `sliding_window` positions only
    /// (each position reads itself and the `sliding_window - 1` before it)
    /// keep their KV in a second pool of `num_window_blocks` blocks, indexed
    /// by a second block table per request whose blocks behind the window
    /// go back to the pool while the request runs. None: one pool.
    pub sliding_window: Option<usize>,
    pub num_window_blocks: usize,
    /// The most distinct LoRA adapters among running requests (and so in a
    /// step); 0: requests with an adapter are refused.
    pub max_adapters: usize,
    /// Recurrent-state slots (a hybrid model's linear-attention layers keep
    /// a fixed-size state per sequence): each running request holds one,
    /// taken on admission and given back when it finishes, is aborted or is
    /// preempted (its state is then recomputed). 0: the model keeps none.
    pub num_state_slots: usize,
    /// With recurrent state and prefix caching: the pool of state snapshots
    /// the prefix cache keeps (a cached prefix resumes such a model only
    /// where a snapshot of the state after it was taken; see
    /// `radix_cache_snapshots.rs`). 0: none.
    pub num_state_snapshots: usize,
    /// Encoder tokens (a vision encoder's output rows) one step may start:
    /// a prefill chunk that reaches the first token of a request's encoder
    /// span (`RequestParams::encoder_spans`: an image) counts the span's
    /// length; a chunk is cut before a span that would pass the budget,
    /// except the step's first span, which always fits. 0: unbounded.
    pub max_encoder_tokens_per_step: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            vocab_size: 32000,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            policy: Policy::Fcfs,
            speculation: None,
            sliding_window: None,
            num_window_blocks: 0,
            max_adapters: 0,
            num_state_slots: 0,
            num_state_snapshots: 0,
            max_encoder_tokens_per_step: 0,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("vocab_size", self.vocab_size),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(CoreError::InvalidArgument(format!(
                    "{name} must be positive"
                )));
            }
        }
        if self.max_model_len < 2 {
            return Err(CoreError::InvalidArgument(
                "max_model_len must be at least 2 (one prompt and one output token)".into(),
            ));
        }
        if self.vocab_size > u32::MAX as usize || self.num_blocks > i32::MAX as usize {
            return Err(CoreError::InvalidArgument(
                "vocab_size and num_blocks must fit in 32 bits".into(),
            ));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(CoreError::InvalidArgument(format!(
                "max_num_batched_tokens ({}) must be at least max_num_seqs ({}) so that every \
                 running request can decode in one step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(CoreError::InvalidArgument(format!(
                "without chunked prefill, max_num_batched_tokens ({}) must be at least \
                 max_model_len ({}) so that the longest prompt fits in one step",
                self.max_num_batched_tokens, self.max_model_len
            )));
        }
        if let Some(spec) = &self.speculation {
            spec.validate()?;
        }
        match self.sliding_window {
            Some(0) => {
                return Err(CoreError::InvalidArgument(
                    "sliding_window must be positive".into(),
                ))
            }
            Some(_)
                if self.num_window_blocks == 0 || self.num_window_blocks > i32::MAX as usize =>
            {
                return Err(CoreError::InvalidArgument(format!(
                    "a sliding window needs num_window_blocks in [1, {}], got {}",
                    i32::MAX,
                    self.num_window_blocks
                )))
            }
            None if self.num_window_blocks != 0 => {
                return Err(CoreError::InvalidArgument(
                    "num_window_blocks without a sliding_window".into(),
                ))
            }
            _ => {}
        }
        if self.num_state_slots > 0 {
            if self.num_state_slots > i32::MAX as usize {
                return Err(CoreError::InvalidArgument(
                    "num_state_slots must fit in 32 bits".into(),
                ));
            }
            // KV alone cannot resume the recurrent state of the tokens it
            // covers: prefix caching needs snapshots of it. A draft's
            // rejected positions would leave their updates in the state.
            if self.enable_prefix_caching && self.num_state_snapshots == 0 {
                return Err(CoreError::InvalidArgument(
                    "prefix caching for a model with recurrent state (num_state_slots > 0) \
                     needs state snapshots (num_state_snapshots > 0)"
                        .into(),
                ));
            }
            if self.num_state_snapshots > 0 && self.sliding_window.is_some() {
                return Err(CoreError::InvalidArgument(
                    "state snapshots with a sliding-window pool are not supported".into(),
                ));
            }
            if self.speculation.is_some() {
                return Err(CoreError::InvalidArgument(
                    "speculative decoding is not supported for a model with recurrent state \
                     (num_state_slots > 0)"
                        .into(),
                ));
            }
        }
        if self.num_state_snapshots > 0
            && (self.num_state_slots == 0 || !self.enable_prefix_caching)
        {
            return Err(CoreError::InvalidArgument(
                "num_state_snapshots needs recurrent state (num_state_slots > 0) and prefix \
                 caching"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The most draft tokens per request and step (0: no speculation).
    pub fn num_speculative_tokens(&self) -> usize {
        self.speculation.map_or(0, |s| s.num_tokens)
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The most window-pool blocks a sequence of `num_tokens` tokens holds
    /// at once: the window behind a step's first position, and the step.
    pub fn window_blocks_for(&self, num_tokens: usize) -> usize {
        match self.sliding_window {
            None => 0,
            Some(w) => {
                let step = self.max_num_batched_tokens + self.num_speculative_tokens();
                self.blocks_for(num_tokens)
                    .min((w - 1 + step).div_ceil(self.block_size) + 1)
            }
        }
    }
}
