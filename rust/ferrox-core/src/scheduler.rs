//! Continuous-batching scheduler: owns the block allocator, the radix prefix
//! cache and every live request; `schedule()` plans one step and `update()`
//! applies its sampled tokens.
//!
//! ```text
//!  request tokens:  | prompt ............................ | outputs ...... |
//!                   | cached prefix | computed earlier | this step | pending |
//!                   ^ shared blocks   (own blocks)       (chunk)
//! ```
//!
//! A step serves running decodes first, then running chunked prefills, then
//! admits waiting requests under the token budget. When blocks run out, the
//! lowest-priority, latest-arriving request is preempted by recompute: its
//! computed full blocks go to the prefix cache, so that its return is mostly
//! a cache hit.
//!
//! Requests that arrive together with a shared prefix (an agent's fan-out)
//! compute it once: a waiting request whose prompt shares more full blocks
//! with a running request's uncomputed prompt than the cache holds waits
//! (at most `MAX_PREFIX_WAIT_STEPS` steps) until that request has computed
//! them and put them in the cache, and requests behind it are admitted
//! meanwhile.
//!
//! A request may run under a LoRA adapter: at most `max_adapters` distinct
//! adapters run at once (a request of another one waits, while those behind
//! it are admitted, for at most `MAX_ADAPTER_WAIT_STEPS` steps; then it
//! blocks them until its adapter gets a turn), and the adapter names the
//! request's prefix-cache namespace.
//!
//! The longest-prefix-match policy (`Policy::Lpm`) tries the waiting
//! requests with the longest cached prefixes first, so that what the cache
//! holds is reused before it is evicted; a request waits so at most
//! `LPM_MAX_WAIT_STEPS` steps.
//!
//! A model with sliding-window layers gives the scheduler a second block
//! pool, for those layers, whose blocks behind each request's window go
//! back while it runs (`scheduler_blocks.rs`); admission, growth and
//! preemption count both pools.
//!
//! A model with recurrent state (linear-attention layers) gives each
//! running request a state slot (admission needs a free one; finish, abort
//! and preemption give it back) and, with prefix caching, saves states at
//! chosen block boundaries into snapshots the radix tree keeps
//! (`scheduler_snapshots.rs`): a hit resumes from the deepest one.

use std::collections::BTreeSet;
use std::ops::Bound::{Excluded, Unbounded};

use rustc_hash::FxHashMap;

use crate::block_allocator::BlockAllocator;
use crate::config::{Policy, SchedulerConfig, SpecMethod};
use crate::error::{CoreError, Result};
use crate::plan::{BatchPlan, SchedulerStats};
use crate::radix_cache::{PrefixMatch, RadixCache};
use crate::request::{Request, RequestParams, RequestStatus};
use crate::speculation::{ngram_proposal, SpecCost, SpecState, SpecStats};

/// Steps a waiting request may wait for another request to compute the
/// prefix they share before it computes its own copy.
pub const MAX_PREFIX_WAIT_STEPS: u32 = 64;

/// Steps a waiting request may be passed over because other adapters fill
/// `max_adapters` before it holds up the requests behind it.
pub const MAX_ADAPTER_WAIT_STEPS: u32 = 64;

/// Under the longest-prefix-match policy: steps a request may wait while
/// requests with longer cached prefixes are served before it; then it is
/// served in arrival order ahead of them.
pub const LPM_MAX_WAIT_STEPS: u64 = 128;

/// Under the longest-prefix-match policy: waiting requests (in arrival
/// order) whose cached prefixes are looked up each step; those behind them
/// keep their arrival order (a long queue costs a bounded lookup).
pub const LPM_MAX_CANDIDATES: usize = 256;

pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) alloc: BlockAllocator,
    /// The sliding-window layers' pool (None: every layer in `alloc`'s).
    pub(crate) window_alloc: Option<BlockAllocator>,
    pub(crate) cache: RadixCache,
    /// Live requests by slot; `index` maps ids to slots.
    pub(crate) slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    /// Recurrent-state slots no request holds (see
    /// `SchedulerConfig::num_state_slots`), the next one given last.
    pub(crate) free_state_slots: Vec<u32>,
    pub(crate) index: FxHashMap<u64, usize>,
    /// (effective priority, arrival, slot) in service order.
    pub(crate) waiting: BTreeSet<(i64, u64, usize)>,
    /// Slots in admission order.
    pub(crate) running: Vec<usize>,
    next_arrival: u64,
    next_step: u64,
    pub(crate) outstanding_step: Option<u64>,
    pending_aborts: Vec<u64>,
    num_preemptions: u64,
    pub(crate) spec_cost: SpecCost,
    pub(crate) spec_stats: SpecStats,
}

/// Work chosen for one request in the step being planned.
#[derive(Clone, Copy)]
pub(crate) struct Chosen {
    pub(crate) slot: usize,
    /// Scheduled tokens, drafts included.
    pub(crate) num_tokens: usize,
    pub(crate) num_draft: usize,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let (window_alloc, cache) = match config.sliding_window {
            None => (None, RadixCache::new(config.block_size, config.num_blocks)?),
            Some(_) => (
                Some(BlockAllocator::new(
                    config.num_window_blocks,
                    config.block_size,
                )?),
                RadixCache::new_windowed(
                    config.block_size,
                    config.num_blocks,
                    config.num_window_blocks,
                )?,
            ),
        };
        let free_state_slots = (0..config.num_state_slots as u32).rev().collect();
        let mut cache = cache;
        if config.num_state_snapshots > 0 {
            cache.enable_snapshots(config.num_state_snapshots)?;
        }
        Ok(Self {
            alloc: BlockAllocator::new(config.num_blocks, config.block_size)?,
            window_alloc,
            cache,
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            free_state_slots,
            index: FxHashMap::default(),
            waiting: BTreeSet::new(),
            running: Vec::new(),
            next_arrival: 0,
            next_step: 1,
            outstanding_step: None,
            pending_aborts: Vec::new(),
            num_preemptions: 0,
            spec_cost: SpecCost::default(),
            spec_stats: SpecStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }
    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }
    pub fn cache(&self) -> &RadixCache {
        &self.cache
    }
    /// The sliding-window layers' pool, if the model has such layers.
    pub fn window_allocator(&self) -> Option<&BlockAllocator> {
        self.window_alloc.as_ref()
    }
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }
    pub fn has_unfinished(&self) -> bool {
        !self.index.is_empty()
    }
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.index.get(&id).and_then(|&s| self.slots[s].as_ref())
    }

    pub fn stats(&self) -> SchedulerStats {
        let evictable = self.cache.num_evictable_blocks();
        let window = self.window_alloc.as_ref();
        SchedulerStats {
            num_window_blocks: window.map_or(0, |w| w.num_blocks()),
            num_free_window_blocks: window.map_or(0, |w| w.num_free()),
            num_cached_window_blocks: window.map_or(0, |w| w.num_cached_only()),
            num_state_slots: self.config.num_state_slots,
            num_free_state_slots: self.free_state_slots.len(),
            num_state_snapshots: self.cache.num_snapshots(),
            num_cached_state_snapshots: self.cache.num_cached_snapshots(),
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_total_blocks: self.alloc.num_blocks(),
            num_free_blocks: self.alloc.num_free(),
            num_used_blocks: self.alloc.num_used() - evictable,
            num_cached_blocks: evictable,
            prefix_queried_tokens: self.cache.num_queried_tokens(),
            prefix_hit_tokens: self.cache.num_hit_tokens(),
            num_preemptions: self.num_preemptions,
            spec: self.spec_stats,
        }
    }

    /// The measured step cost that adaptive speculation weighs drafts by.
    pub fn set_spec_cost(&mut self, cost: SpecCost) -> Result<()> {
        let fields = [cost.step_seconds, cost.token_seconds, cost.draft_seconds];
        if fields.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(CoreError::InvalidArgument(format!(
                "step costs must be finite and non-negative, got {cost:?}"
            )));
        }
        self.spec_cost = cost;
        Ok(())
    }

    pub(crate) fn priority_key(&self, req: &Request) -> i64 {
        match self.config.policy {
            Policy::Fcfs | Policy::Lpm => 0,
            Policy::Priority => req.params.priority as i64,
        }
    }

    /// Under the longest-prefix-match policy, the waiting queue in the order
    /// admission tries it: requests overdue (waited `LPM_MAX_WAIT_STEPS`
    /// steps, or preempted) in arrival order, then the others by the length
    /// of their cached prefix, longest first, then arrival; requests past
    /// the first `LPM_MAX_CANDIDATES` keep their arrival order at the end.
    fn lpm_order(&self) -> Vec<(i64, u64, usize)> {
        let mut keyed: Vec<_> = self
            .waiting
            .iter()
            .take(LPM_MAX_CANDIDATES)
            .map(|&entry| {
                let req = self.req(entry.2);
                let waited = self.next_step.saturating_sub(req.queued_at_step);
                let overdue = req.num_preemptions > 0 || waited >= LPM_MAX_WAIT_STEPS;
                let cached = if overdue || !req.params.use_prefix_cache {
                    0
                } else {
                    let prompt = &req.tokens[..req.num_tokens() - 1];
                    let ns = req.params.adapter as u64;
                    self.cache.walk(ns, prompt).num_tokens
                };
                ((!overdue, std::cmp::Reverse(cached), entry.1), entry)
            })
            .collect();
        keyed.sort_unstable_by_key(|&(rank, _)| rank);
        let rest = self.waiting.iter().skip(LPM_MAX_CANDIDATES).copied();
        keyed
            .into_iter()
            .map(|(_, entry)| entry)
            .chain(rest)
            .collect()
    }

    pub(crate) fn req(&self, slot: usize) -> &Request {
        self.slots[slot].as_ref().expect("live slot")
    }

    pub(crate) fn req_mut(&mut self, slot: usize) -> &mut Request {
        self.slots[slot].as_mut().expect("live slot")
    }

    /// Queues a request. Rejected with no state change: a duplicate id, an
    /// empty prompt, a token outside the vocabulary, a prompt that leaves no
    /// room for output, `max_tokens == 0`, or a request the whole pool could
    /// never hold.
    pub fn add_request(&mut self, id: u64, prompt: &[u32], params: RequestParams) -> Result<()> {
        let reject = |reason: String| Err(CoreError::RequestRejected { id, reason });
        let cfg = &self.config;
        if self.index.contains_key(&id) {
            return Err(CoreError::DuplicateRequest { id });
        }
        if prompt.is_empty() {
            return reject("the prompt is empty".into());
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return reject(format!(
                "token id {bad} is outside the vocabulary [0, {})",
                cfg.vocab_size
            ));
        }
        if prompt.len() >= cfg.max_model_len {
            return reject(format!(
                "the prompt has {} tokens, but max_model_len is {} (room for at least one \
                 output token is needed)",
                prompt.len(),
                cfg.max_model_len
            ));
        }
        if params.max_tokens == 0 {
            return reject("max_tokens must be at least 1".into());
        }
        let mut last_end = 0;
        for &(s, e) in &params.encoder_spans {
            if s < last_end || e <= s || e > prompt.len() {
                return reject(format!(
                    "encoder span [{s}, {e}) is empty, unsorted, overlaps another or leaves the \
                     prompt of {} tokens",
                    prompt.len()
                ));
            }
            last_end = e;
        }
        let mut last_end = 0;
        for &(s, e) in &params.atomic_spans {
            if s < last_end || e <= s || e > prompt.len() {
                return reject(format!(
                    "atomic span [{s}, {e}) is empty, unsorted, overlaps another or leaves the \
                     prompt of {} tokens",
                    prompt.len()
                ));
            }
            if e - s > cfg.max_num_batched_tokens && cfg.enable_chunked_prefill {
                return reject(format!(
                    "atomic span [{s}, {e}) of {} tokens cannot run in one step of at most \
                     max_num_batched_tokens={} tokens",
                    e - s,
                    cfg.max_num_batched_tokens
                ));
            }
            last_end = e;
        }
        if !params.atomic_spans.is_empty() && cfg.num_state_snapshots > 0 {
            return reject(
                "atomic spans are not supported with recurrent-state snapshots (a snapshot \
                 boundary inside one would never be reached)"
                    .into(),
            );
        }
        if params.adapter != 0 && cfg.max_adapters == 0 {
            return reject(format!(
                "it names adapter {}, but this scheduler serves no adapters (max_adapters is 0)",
                params.adapter
            ));
        }
        // Drafts never reach past this length (they are capped by the room left).
        let max_len = prompt
            .len()
            .saturating_add(params.max_tokens)
            .min(cfg.max_model_len);
        let blocks_needed = cfg.blocks_for(max_len);
        if blocks_needed > cfg.num_blocks {
            return reject(format!(
                "it may grow to {max_len} tokens ({blocks_needed} KV blocks), but the KV pool \
                 holds only {} blocks",
                cfg.num_blocks
            ));
        }
        let window_needed = cfg.window_blocks_for(max_len);
        if window_needed > cfg.num_window_blocks && cfg.sliding_window.is_some() {
            return reject(format!(
                "its sliding window needs up to {window_needed} KV blocks at once, but the \
                 window pool holds only {} blocks",
                cfg.num_window_blocks
            ));
        }
        let request = Request {
            id,
            arrival: self.next_arrival,
            params,
            status: RequestStatus::Waiting,
            tokens: prompt.to_vec(),
            num_prompt_tokens: prompt.len(),
            num_computed_tokens: 0,
            block_table: Vec::new(),
            window_table: Vec::new(),
            window_start: 0,
            state_slot: None,
            snapshot_boundaries: Vec::new(),
            pending_saves: Vec::new(),
            restore_from: None,
            kv_copy: None,
            cache_handle: None,
            num_shared_blocks: 0,
            num_prefix_hit_tokens: 0,
            num_preemptions: 0,
            protected_until: None,
            num_prefix_wait_steps: 0,
            num_adapter_wait_steps: 0,
            queued_at_step: self.next_step,
            draft: Vec::new(),
            spec: SpecState::starting_at(self.spec_stats.accept_rate),
        };
        self.next_arrival += 1;
        let key = (self.priority_key(&request), request.arrival);
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(request);
                slot
            }
            None => {
                self.slots.push(Some(request));
                self.slots.len() - 1
            }
        };
        self.index.insert(id, slot);
        self.waiting.insert((key.0, key.1, slot));
        Ok(())
    }

    /// Ends a request in any state; its computed blocks go to the prefix
    /// cache. Returns false for an unknown id.
    pub fn abort(&mut self, id: u64) -> Result<bool> {
        let Some(&slot) = self.index.get(&id) else {
            return Ok(false);
        };
        self.remove_request(slot)?;
        self.pending_aborts.push(id);
        Ok(true)
    }

    pub(crate) fn remove_request(&mut self, slot: usize) -> Result<()> {
        let req = self.req(slot);
        match req.status {
            RequestStatus::Waiting => {
                let key = (self.priority_key(req), req.arrival, slot);
                self.waiting.remove(&key);
            }
            RequestStatus::Running => {
                self.release_blocks(slot)?;
                self.running.retain(|&s| s != slot);
            }
        }
        let req = self.slots[slot].take().expect("live slot");
        self.index.remove(&req.id);
        self.free_slots.push(slot);
        Ok(())
    }

    /// The running request to preempt: lowest priority, then latest arrival,
    /// skipping requests preempted before that have not progressed since,
    /// unless only such requests are left.
    fn pick_victim(&self) -> Option<usize> {
        let rank = |&slot: &usize| {
            let r = self.req(slot);
            (self.priority_key(r), r.arrival)
        };
        let unprotected = self
            .running
            .iter()
            .filter(|&&s| !self.req(s).is_protected())
            .max_by_key(|s| rank(s));
        unprotected
            .or_else(|| self.running.iter().max_by_key(|s| rank(s)))
            .copied()
    }

    fn preempt(&mut self, slot: usize, chosen: &mut Vec<Chosen>, budget: &mut usize) -> Result<()> {
        self.release_blocks(slot)?;
        self.running.retain(|&s| s != slot);
        if let Some(pos) = chosen.iter().position(|c| c.slot == slot) {
            *budget += chosen.remove(pos).num_tokens;
        }
        let key = {
            let req = self.req(slot);
            self.priority_key(req)
        };
        let step = self.next_step;
        let req = self.req_mut(slot);
        req.status = RequestStatus::Waiting;
        req.num_computed_tokens = 0;
        req.kv_copy = None;
        req.draft.clear();
        req.num_preemptions += 1;
        req.protected_until = Some(req.num_output_tokens());
        req.queued_at_step = step;
        let arrival = req.arrival;
        self.waiting.insert((key, arrival, slot));
        self.num_preemptions += 1;
        Ok(())
    }

    /// Plans one step. Fails if the previous plan has not been updated.
    pub fn schedule(&mut self) -> Result<BatchPlan> {
        if let Some(step) = self.outstanding_step {
            return Err(CoreError::PlanMismatch(format!(
                "step {step} was scheduled but never updated"
            )));
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut encoded = 0; // encoder tokens the step's chunks start
        let mut chosen: Vec<Chosen> = Vec::with_capacity(self.running.len() + 8);
        let mut preempted = Vec::new();
        let snapshot = self.running.clone();
        let threshold = self.spec_threshold(&snapshot);
        for decode_pass in [true, false] {
            for &slot in &snapshot {
                if budget == 0 {
                    break;
                }
                let Some(req) = self.slots[slot].as_ref() else {
                    continue;
                };
                let pending = req.num_pending_tokens();
                if req.status != RequestStatus::Running || (pending == 1) != decode_pass {
                    continue;
                }
                let num_tokens = self.up_to_boundary(slot, pending.min(budget));
                if num_tokens < pending && !self.config.enable_chunked_prefill {
                    continue;
                }
                let start = req.num_computed_tokens;
                let (num_tokens, cost) = self.fit_chunk(slot, start, num_tokens, pending, encoded);
                if num_tokens == 0 {
                    continue; // an image waits for a step with room for it
                }
                let num_draft = match threshold {
                    Some(t) if decode_pass => self.propose(slot, t, budget - 1),
                    _ => 0,
                };
                let num_tokens = num_tokens + num_draft;
                let req = self.req(slot);
                let need_tokens = req.num_computed_tokens + num_tokens;
                let need_blocks = self
                    .config
                    .blocks_for(need_tokens)
                    .saturating_sub(req.block_table.len());
                let mut scheduled = true;
                while !self.grow_table(slot, need_blocks)? {
                    let victim = self.pick_victim().expect("the requester is running");
                    preempted.push(self.req(victim).id);
                    self.preempt(victim, &mut chosen, &mut budget)?;
                    if victim == slot {
                        scheduled = false;
                        break;
                    }
                }
                if scheduled {
                    chosen.push(Chosen {
                        slot,
                        num_tokens,
                        num_draft,
                    });
                    budget -= num_tokens;
                    encoded += cost;
                    self.plan_snapshot(slot, num_tokens);
                } else {
                    self.req_mut(slot).draft.clear();
                }
            }
        }
        if preempted.is_empty() {
            self.admit_waiting(&mut chosen, &mut budget, &mut encoded, &mut preempted)?;
        }
        let step_id = self.next_step;
        self.next_step += 1;
        self.outstanding_step = Some(step_id);
        let aborted = std::mem::take(&mut self.pending_aborts);
        Ok(self.build_plan(step_id, chosen, preempted, aborted))
    }

    /// Admits waiting requests in service order while budget, sequence slots
    /// and blocks last. The first that does not fit blocks those behind it;
    /// one that waits for a running request's prefix does not.
    fn admit_waiting(
        &mut self,
        chosen: &mut Vec<Chosen>,
        budget: &mut usize,
        encoded: &mut usize,
        preempted: &mut Vec<u64>,
    ) -> Result<()> {
        let bs = self.config.block_size;
        let snapshots = self.config.num_state_snapshots > 0;
        let mut leaders = if self.config.enable_prefix_caching {
            self.prefix_leaders()
        } else {
            Vec::new()
        };
        let mut adapters = self.running_adapters();
        let mut after: Option<(i64, u64, usize)> = None;
        let stateful = self.config.num_state_slots > 0;
        // Partial-block copies: for a pool of full attention only (a state
        // or window would need the same positions too).
        let copies = !stateful && self.config.sliding_window.is_none();
        let can_admit = *budget > 0 && self.running.len() < self.config.max_num_seqs;
        let lpm = self.config.policy == Policy::Lpm && self.config.enable_prefix_caching;
        let mut listed = match lpm && can_admit && !self.waiting.is_empty() {
            true => Some(self.lpm_order().into_iter()),
            false => None,
        };
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            if stateful && self.free_state_slots.is_empty() {
                break;
            }
            let next = match (&mut listed, after) {
                (Some(order), _) => order.next(),
                (None, None) => self.waiting.first().copied(),
                (None, Some(last)) => self
                    .waiting
                    .range((Excluded(last), Unbounded))
                    .next()
                    .copied(),
            };
            let Some((key, arrival, slot)) = next else {
                break;
            };
            after = Some((key, arrival, slot));
            let req = self.slots[slot].as_ref().expect("live slot");
            let adapter = req.params.adapter;
            if adapter != 0
                && !adapters.contains(&adapter)
                && adapters.len() >= self.config.max_adapters
            {
                if req.num_adapter_wait_steps >= MAX_ADAPTER_WAIT_STEPS {
                    break; // its turn: no request behind it starts another adapter's run
                }
                self.req_mut(slot).num_adapter_wait_steps += 1;
                continue;
            }
            let total = req.num_tokens();
            let (mut restore, mut kv_tokens) = (None, 0);
            let found = if self.config.enable_prefix_caching {
                let reusable = if req.params.use_prefix_cache {
                    total - 1
                } else {
                    0
                };
                let tokens = &req.tokens[..reusable];
                let ns = adapter as u64;
                Some(match self.config.sliding_window {
                    _ if snapshots => {
                        let m = self.cache.split_and_touch_snapshot_prefix(ns, tokens);
                        (restore, kv_tokens) = (m.snapshot, m.kv_tokens);
                        m.hit
                    }
                    None => self.cache.split_and_touch_prefix(ns, tokens),
                    Some(w) => self.cache.split_and_touch_windowed_prefix(ns, tokens, w),
                })
            } else {
                None
            };
            let (hit_tokens, hit_blocks) = found
                .as_ref()
                .map_or((0, 0), |m| (m.num_tokens, m.blocks.len()));
            let waits_for = match found {
                Some(_) => self.shared_prefix_leader(slot, hit_tokens, &leaders),
                None => None,
            };
            if let Some((leader, boundary)) = waits_for {
                if snapshots {
                    self.snapshot_for_follower(leader, boundary, chosen, budget)?;
                }
                self.req_mut(slot).num_prefix_wait_steps += 1;
                continue;
            }
            if let Some(m) = &found {
                self.cache.lock(m.handle)?;
            }
            let copy = match &found {
                Some(m) if hit_tokens > 0 && copies => self.partial_block_copy(slot, m)?,
                _ => None,
            };
            let start = hit_tokens + copy.map_or(0, |(_, n)| n);
            let pending = total - start;
            let boundaries = if snapshots {
                self.snapshot_boundaries(slot, hit_tokens, kv_tokens)
            } else {
                Vec::new()
            };
            let num_tokens = match boundaries.first() {
                Some(&b) => pending.min(*budget).min(b - hit_tokens),
                None => pending.min(*budget),
            };
            let (num_tokens, cost) = self.fit_chunk(slot, start, num_tokens, pending, *encoded);
            if num_tokens == 0 {
                // An image waits for a step with room for it.
                if let Some(m) = &found {
                    self.cache.unlock(m.handle)?;
                }
                break;
            }
            let fits_budget = num_tokens == pending || self.config.enable_chunked_prefill;
            let need_blocks = self.config.blocks_for(start + num_tokens) - hit_blocks;
            let mut has_room = fits_budget && self.has_room_after(need_blocks, found.as_ref());
            // Under the priority policy a more urgent request displaces the
            // least urgent running one.
            while fits_budget && !has_room && self.config.policy == Policy::Priority {
                match self.pick_victim() {
                    Some(v) if self.priority_key(self.req(v)) > key => {
                        preempted.push(self.req(v).id);
                        self.preempt(v, chosen, budget)?;
                        has_room = self.has_room_after(need_blocks, found.as_ref());
                    }
                    _ => break,
                }
            }
            if !has_room {
                if let Some(m) = &found {
                    self.cache.unlock(m.handle)?;
                }
                break;
            }
            let num_tokens = num_tokens.min(*budget);
            self.waiting.remove(&(key, arrival, slot));
            if let Some(m) = found {
                self.cache.record_query(total, start);
                self.adopt_hit(slot, m)?;
            }
            let need_blocks = self.config.blocks_for(start + num_tokens) - hit_blocks;
            let grown = self.grow_table(slot, need_blocks)?;
            debug_assert!(grown, "room was checked");
            let state_slot = if stateful {
                self.free_state_slots.pop()
            } else {
                None
            };
            let req = self.req_mut(slot);
            req.status = RequestStatus::Running;
            req.state_slot = state_slot;
            req.snapshot_boundaries = boundaries;
            req.restore_from = if hit_tokens > 0 { restore } else { None };
            req.kv_copy = copy;
            req.num_computed_tokens = start;
            req.num_shared_blocks = hit_blocks;
            if req.num_preemptions == 0 {
                req.num_prefix_hit_tokens = start;
            }
            debug_assert_eq!(hit_tokens % bs, 0);
            self.running.push(slot);
            if adapter != 0 && !adapters.contains(&adapter) {
                adapters.push(adapter);
            }
            if self.is_prefix_leader(slot) {
                leaders.push(slot);
            }
            chosen.push(Chosen {
                slot,
                num_tokens,
                num_draft: 0,
            });
            *budget -= num_tokens;
            *encoded += cost;
            self.plan_snapshot(slot, num_tokens);
        }
        Ok(())
    }

    /// A prefill chunk of `num_tokens` from `start` of the request in
    /// `slot` (of its `pending` tokens), cut before an encoder span past
    /// the step's encoder budget (`encoded`: spent so far) and so that it
    /// ends outside every atomic span: its length (0: it cannot run this
    /// step) and the encoder tokens it starts.
    fn fit_chunk(
        &self,
        slot: usize,
        start: usize,
        num_tokens: usize,
        pending: usize,
        encoded: usize,
    ) -> (usize, usize) {
        let req = self.req(slot);
        let limit = self.config.max_encoder_tokens_per_step;
        let (mut n, _) = req.within_encoder_budget(start, num_tokens, encoded, limit);
        if n < pending {
            if !self.config.enable_chunked_prefill {
                return (0, 0);
            }
            n = req.outside_atomic_spans(start, n);
        }
        (n, req.within_encoder_budget(start, n, encoded, limit).1)
    }

    /// After the prefix-cache hit `hit` of the waiting request in `slot`: a
    /// cached block that begins as its next tokens do, whose KV it copies
    /// for those positions (at most a block less one, and never its last
    /// token: that one is computed for its logits). None when no such block,
    /// and for a request with atomic spans (images whose tokens attend both
    /// ways: a position's KV depends on the tokens after it).
    fn partial_block_copy(&self, slot: usize, hit: &PrefixMatch) -> Result<Option<(u32, usize)>> {
        let req = self.req(slot);
        let start = hit.num_tokens;
        let end = (start + self.config.block_size).min(req.num_tokens() - 1);
        if end <= start || !req.params.atomic_spans.is_empty() {
            return Ok(None);
        }
        self.cache
            .partial_block_match(hit.handle, &req.tokens[start..end])
    }

    /// The distinct adapters (not 0) of the running requests.
    pub(crate) fn running_adapters(&self) -> Vec<u32> {
        let mut adapters: Vec<u32> = Vec::new();
        for &slot in &self.running {
            let a = self.req(slot).params.adapter;
            if a != 0 && !adapters.contains(&a) {
                adapters.push(a);
            }
        }
        adapters
    }

    /// Running requests with full prompt blocks still to compute: those a
    /// waiting request may wait for (few: the prompts being prefilled).
    pub(crate) fn prefix_leaders(&self) -> Vec<usize> {
        let running = self.running.iter().copied();
        running
            .filter(|&slot| self.is_prefix_leader(slot))
            .collect()
    }

    fn is_prefix_leader(&self, slot: usize) -> bool {
        let req = self.req(slot);
        req.num_computed_tokens
            < req.num_prompt_tokens / self.config.block_size * self.config.block_size
    }

    /// Whether the waiting request in `slot`, whose cache hit is `hit_tokens`,
    /// shares full blocks beyond it with the uncomputed prompt of one of
    /// `leaders`: then it waits for that request to compute them (a bounded
    /// number of steps) instead of computing a copy of its own. Returns that
    /// leader and the block boundary where the prefix they share ends.
    pub(crate) fn shared_prefix_leader(
        &self,
        slot: usize,
        hit_tokens: usize,
        leaders: &[usize],
    ) -> Option<(usize, usize)> {
        let req = self.req(slot);
        if !req.params.use_prefix_cache || req.num_prefix_wait_steps >= MAX_PREFIX_WAIT_STEPS {
            return None;
        }
        let bs = self.config.block_size;
        let own = &req.tokens[..req.num_tokens() - 1];
        let first_new = hit_tokens + bs; // the shared prefix must reach past the cache hit
        leaders.iter().find_map(|&other| {
            let leader = self.req(other);
            if leader.params.adapter != req.params.adapter {
                return None; // (its blocks are another namespace's)
            }
            let prompt = &leader.tokens[..leader.num_prompt_tokens];
            if own.len() < first_new || prompt.len() < first_new {
                return None;
            }
            if own[..first_new] != prompt[..first_new] {
                return None; // (a slice compare: most prompts differ early)
            }
            let common = first_new
                + own[first_new..]
                    .iter()
                    .zip(&prompt[first_new..])
                    .take_while(|(a, b)| a == b)
                    .count();
            let boundary = common / bs * bs;
            (leader.num_computed_tokens < boundary).then_some((other, boundary))
        })
    }

    /// The acceptance probability a draft position must reach this step, or
    /// None when the step does not speculate.
    fn spec_threshold(&self, running: &[usize]) -> Option<f64> {
        let spec = self.config.speculation?;
        if matches!(spec.disable_by_batch_size, Some(limit) if running.len() > limit) {
            return None;
        }
        if !spec.adaptive {
            return Some(0.0);
        }
        let decodes = running
            .iter()
            .filter(|&&s| self.req(s).num_pending_tokens() == 1)
            .count();
        Some(self.spec_cost.threshold(decodes))
    }

    /// Sets a decoding request's drafts for this step (at most `budget`);
    /// returns how many. They never take the request past `max_tokens` or
    /// `max_model_len`: the step yields at most one token more than drafts.
    fn propose(&mut self, slot: usize, threshold: f64, budget: usize) -> usize {
        let spec = self.config.speculation.expect("speculation is on");
        let max_model_len = self.config.max_model_len;
        let req = self.slots[slot].as_mut().expect("live slot");
        let room = (req
            .params
            .max_tokens
            .saturating_sub(req.num_output_tokens()))
        .min(max_model_len.saturating_sub(req.num_tokens()))
        .saturating_sub(1);
        let limit = spec.num_tokens.min(room).min(budget);
        let (available, proposal) = match spec.method {
            SpecMethod::Ngram { min, max } => {
                let p = ngram_proposal(&req.tokens, min, max, limit);
                (p.len(), Some(p))
            }
            SpecMethod::External => (limit, None),
        };
        let len = if spec.adaptive {
            req.spec.draft_length(available, threshold)
        } else {
            available
        };
        req.draft.clear();
        match proposal {
            Some(p) => req.draft.extend_from_slice(&p[..len]),
            None => req.draft.resize(len, 0),
        }
        len
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
