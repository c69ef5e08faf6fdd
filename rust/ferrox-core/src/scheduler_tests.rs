use super::*;
use crate::block_allocator::NULL_BLOCK;
use crate::{BatchPlan, FinishReason, RequestParams, SchedulerConfig, SpecConfig};
use proptest::prelude::*;

const VOCAB: usize = 50;
const EOS: u32 = 0;
/// The fake model's KV for token t under adapter a is t + a * this.
const ADAPTER_KV_OFFSET: u32 = 1000;

fn config(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        vocab_size: VOCAB,
        max_adapters: 2,
        ..SchedulerConfig::default()
    }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        max_tokens,
        eos_token_ids: vec![EOS],
        ..RequestParams::default()
    }
}

/// A deterministic stand-in for a model that reads its context back from a
/// simulated paged KV store, so that a wrong block table, slot mapping or
/// prefix-cache hit changes the tokens it produces. With a window it also
/// has sliding-window layers: they read the last `window` positions from
/// the window pool's store (from the full one under a plan without window
/// tables), and their reading changes the token too. Under a plan with
/// state slots it also has recurrent layers: a state per slot that folds in
/// every token the slot's rows feed it (started afresh by a row with no
/// computed tokens); without state slots the same fold is taken over the
/// context read back from the KV store, so a state that was not reset,
/// shared, or resumed wrongly changes the token.
struct FakeModel {
    kv: Vec<Option<(u32, i64)>>,
    window_kv: Vec<Option<(u32, i64)>>,
    window: Option<usize>,
    block_size: usize,
    states: Vec<Option<u64>>,
    snapshots: Vec<Option<u64>>,
}

impl FakeModel {
    fn new(cfg: &SchedulerConfig) -> Self {
        Self::with_window(cfg, cfg.sliding_window)
    }

    fn with_window(cfg: &SchedulerConfig, window: Option<usize>) -> Self {
        Self {
            kv: vec![None; cfg.num_blocks * cfg.block_size],
            window_kv: vec![None; cfg.num_window_blocks * cfg.block_size],
            window,
            block_size: cfg.block_size,
            states: vec![None; cfg.num_state_slots],
            snapshots: vec![None; cfg.num_state_snapshots],
        }
    }

    /// The recurrent layers' fold of one more token.
    fn fold(state: u64, token: u32) -> u64 {
        state.wrapping_mul(31).wrapping_add(token as u64 + 1)
    }

    /// The recurrent state after a context read back from the KV store.
    fn context_state(context: &[u32]) -> u64 {
        context
            .iter()
            .fold(0, |h, &t| Self::fold(h, t % ADAPTER_KV_OFFSET))
    }

    /// The token after `context` (full-attention layers) given the
    /// recurrent state (without window layers).
    fn token_of(context: &[u32], state: u64) -> u32 {
        (Self::next_token(context) + (state % VOCAB as u64) as u32) % VOCAB as u32
    }

    /// Reads positions `range` of a row through its block table.
    fn read(
        kv: &[Option<(u32, i64)>],
        table: &[i32],
        bs: usize,
        range: std::ops::Range<usize>,
    ) -> Vec<u32> {
        range
            .map(|p| {
                let slot = table[p / bs] as usize * bs + p % bs;
                let (tok, pos) = kv[slot].expect("context slot was never written");
                assert_eq!(pos, p as i64, "slot holds another position");
                tok
            })
            .collect()
    }

    fn next_token(context: &[u32]) -> u32 {
        let mut h: u64 = 1469598103934665603;
        for &t in context {
            h = (h ^ t as u64).wrapping_mul(1099511628211);
        }
        (h % VOCAB as u64) as u32
    }

    fn run(&mut self, plan: &BatchPlan) -> Vec<u32> {
        let bs = self.block_size;
        let windowed = !plan.window_slot_mapping.is_empty();
        // Partial-block copies first, every source read before any write.
        let copied: Vec<_> = plan
            .kv_copy_src
            .iter()
            .map(|&s| self.kv[s as usize])
            .collect();
        for (&dst, entry) in plan.kv_copy_dst.iter().zip(copied) {
            assert!(entry.is_some(), "a copy from a slot never written");
            self.kv[dst as usize] = entry;
        }
        let mut row_of_token = vec![0usize; plan.input_ids.len()];
        for row in 0..plan.num_reqs() {
            let (qs, qe) = (plan.query_start_loc[row], plan.query_start_loc[row + 1]);
            row_of_token[qs as usize..qe as usize].fill(row);
        }
        for (i, &tok) in plan.input_ids.iter().enumerate() {
            // A row's adapter changes the KV it writes (as LoRA on k/v does).
            let adapter = plan.adapters[row_of_token[i]];
            let entry = Some((tok as u32 + ADAPTER_KV_OFFSET * adapter, plan.positions[i]));
            self.kv[plan.slot_mapping[i] as usize] = entry;
            if windowed {
                self.window_kv[plan.window_slot_mapping[i] as usize] = entry;
            }
        }
        // The recurrent state after each row's tokens.
        let stateful = !plan.state_slots.is_empty();
        let mut row_states = vec![0u64; plan.num_reqs()];
        for pair in plan.state_restores.chunks(2) {
            let (snapshot, slot) = (pair[0] as usize, pair[1] as usize);
            let saved = self.snapshots[snapshot].expect("a restore from a snapshot never written");
            self.states[slot] = Some(saved);
        }
        if stateful {
            for (row, state) in row_states.iter_mut().enumerate() {
                let slot = plan.state_slots[row] as usize;
                let held = if plan.num_computed_tokens[row] == 0 {
                    0
                } else {
                    self.states[slot].expect("a state slot read before it was written")
                };
                let (qs, qe) = (plan.query_start_loc[row], plan.query_start_loc[row + 1]);
                *state = plan.input_ids[qs as usize..qe as usize]
                    .iter()
                    .fold(held, |h, &t| Self::fold(h, t as u32));
                self.states[slot] = Some(*state);
            }
        }
        for pair in plan.state_saves.chunks(2) {
            let (slot, snapshot) = (pair[0] as usize, pair[1] as usize);
            self.snapshots[snapshot] = self.states[slot];
        }
        let width = plan.block_table_width;
        let mut out = vec![];
        for (&row, &index) in plan.sample_rows.iter().zip(&plan.logits_indices) {
            let row = row as usize;
            // The context up to the sampled position (drafts included).
            let seq_len = plan.positions[index as usize] as usize + 1;
            let table = &plan.block_table[row * width..];
            let context = Self::read(&self.kv, table, bs, 0..seq_len);
            let state = if stateful {
                row_states[row]
            } else {
                Self::context_state(&context)
            };
            let mut token = Self::token_of(&context, state);
            if let Some(w) = self.window {
                let range = seq_len.saturating_sub(w)..seq_len;
                let seen = if windowed {
                    Self::read(
                        &self.window_kv,
                        &plan.window_block_table[row * width..],
                        bs,
                        range,
                    )
                } else {
                    Self::read(&self.kv, table, bs, range)
                };
                token = (token + Self::next_token(&seen)) % VOCAB as u32;
            }
            out.push(token);
        }
        out
    }
}

/// Checks the plan's shape and budgets against the config.
fn check_plan(plan: &BatchPlan, cfg: &SchedulerConfig) {
    let b = plan.num_reqs();
    assert!(b <= cfg.max_num_seqs);
    assert!(plan.num_tokens() <= cfg.max_num_batched_tokens);
    assert_eq!(plan.query_start_loc.len(), b + 1);
    assert_eq!(
        *plan.query_start_loc.last().unwrap() as usize,
        plan.num_tokens()
    );
    assert_eq!(plan.block_table.len(), b * plan.block_table_width);
    assert_eq!(plan.kv_copy_src.len(), plan.kv_copy_dst.len());
    if cfg.sliding_window.is_some() || cfg.num_state_slots > 0 {
        assert!(
            plan.kv_copy_src.is_empty(),
            "copies for a full-attention pool only"
        );
    }
    if cfg.num_state_slots > 0 {
        assert_eq!(plan.state_slots.len(), b);
        let distinct: std::collections::HashSet<_> = plan.state_slots.iter().collect();
        assert_eq!(distinct.len(), b, "two rows share a state slot");
        assert!(plan
            .state_slots
            .iter()
            .all(|&s| (s as usize) < cfg.num_state_slots));
    } else {
        assert!(plan.state_slots.is_empty());
    }
    for row in 0..b {
        let (qs, qe) = (
            plan.query_start_loc[row] as usize,
            plan.query_start_loc[row + 1] as usize,
        );
        assert_eq!(qe - qs, plan.num_scheduled_tokens[row] as usize);
        assert_eq!(
            plan.seq_lens[row],
            plan.num_computed_tokens[row] + plan.num_scheduled_tokens[row]
        );
        if row < plan.num_decodes {
            assert_eq!(plan.num_scheduled_tokens[row], 1);
        }
        let d = plan.num_draft_tokens[row] as usize;
        assert!(d <= cfg.num_speculative_tokens());
        let samples = plan
            .sample_rows
            .iter()
            .filter(|&&r| r as usize == row)
            .count();
        assert!(
            samples == 0 || samples == 1 + d,
            "row {row}: {samples} samples, {d} drafts"
        );
        for t in qs..qe {
            let pos = plan.positions[t] as usize;
            let block = plan.block_table[row * plan.block_table_width + pos / cfg.block_size];
            assert_eq!(
                plan.slot_mapping[t],
                block as i64 * cfg.block_size as i64 + (pos % cfg.block_size) as i64
            );
        }
    }
}

/// Runs until every request ends (and `on_step` has seen at least
/// `min_steps` steps); returns the finished outputs by id.
fn drive(
    sched: &mut Scheduler,
    model: &mut FakeModel,
    mut on_step: impl FnMut(&mut Scheduler, usize),
) -> std::collections::HashMap<u64, (Vec<u32>, FinishReason)> {
    drive_for(sched, model, 0, &mut on_step)
}

fn drive_for(
    sched: &mut Scheduler,
    model: &mut FakeModel,
    min_steps: usize,
    on_step: &mut impl FnMut(&mut Scheduler, usize),
) -> std::collections::HashMap<u64, (Vec<u32>, FinishReason)> {
    drive_with(sched, model, min_steps, on_step, None)
}

/// Writes a plan's drafts (a draft model's part) and returns them.
type Drafter<'a> = &'a mut dyn FnMut(&Scheduler, &mut BatchPlan) -> Vec<u32>;

fn drive_with(
    sched: &mut Scheduler,
    model: &mut FakeModel,
    min_steps: usize,
    on_step: &mut impl FnMut(&mut Scheduler, usize),
    mut drafter: Option<Drafter<'_>>,
) -> std::collections::HashMap<u64, (Vec<u32>, FinishReason)> {
    let cfg = sched.config().clone();
    let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut finished = std::collections::HashMap::new();
    for step in 0..10_000 {
        on_step(sched, step);
        if !sched.has_unfinished() && step >= min_steps {
            break;
        }
        let mut plan = sched.schedule().unwrap();
        check_plan(&plan, &cfg);
        sched.check_integrity().unwrap();
        let drafts = drafter.as_mut().map(|d| d(sched, &mut plan));
        let sampled = model.run(&plan);
        let events = sched
            .update(&plan, &sampled, &[], drafts.as_deref())
            .unwrap();
        sched.check_integrity().unwrap();
        for i in 0..events.len() {
            let id = events.req_ids[i];
            if events.token_ids[i] >= 0 {
                outputs
                    .entry(id)
                    .or_default()
                    .push(events.token_ids[i] as u32);
            }
            let reason = match events.finish_reasons[i] {
                0 => continue,
                1 => FinishReason::Stop,
                2 => FinishReason::Length,
                _ => FinishReason::Abort,
            };
            finished.insert(id, (outputs.remove(&id).unwrap_or_default(), reason));
        }
    }
    assert!(!sched.has_unfinished(), "requests never finished");
    finished
}

fn run_alone(prompt: &[u32], p: RequestParams) -> (Vec<u32>, FinishReason) {
    run_alone_within(prompt, p, 64)
}

fn run_alone_within(
    prompt: &[u32],
    p: RequestParams,
    max_model_len: usize,
) -> (Vec<u32>, FinishReason) {
    run_alone_windowed(prompt, p, max_model_len, None)
}

/// A request alone in a one-pool scheduler, under a model whose window
/// layers (if `window`) read the full pool's blocks.
fn run_alone_windowed(
    prompt: &[u32],
    p: RequestParams,
    max_model_len: usize,
    window: Option<usize>,
) -> (Vec<u32>, FinishReason) {
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        max_model_len,
        ..config(64, 64)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::with_window(&cfg, window);
    sched.add_request(1, prompt, p).unwrap();
    drive(&mut sched, &mut model, |_, _| {}).remove(&1).unwrap()
}

fn assert_idle(sched: &Scheduler) {
    sched.check_integrity().unwrap();
    let stats = sched.stats();
    assert_eq!(stats.num_used_blocks, 0);
    assert_eq!(
        stats.num_free_blocks + stats.num_cached_blocks,
        stats.num_total_blocks
    );
}

#[test]
fn rejects_bad_requests_without_state_change() {
    let mut sched = Scheduler::new(config(8, 32)).unwrap();
    let reject = |r: Result<()>| assert!(matches!(r, Err(CoreError::RequestRejected { .. })));
    reject(sched.add_request(1, &[], params(4)));
    reject(sched.add_request(1, &[1, VOCAB as u32], params(4)));
    reject(sched.add_request(1, &[1; 64], params(4)));
    reject(sched.add_request(1, &[1, 2], params(0)));
    // 8 blocks of 4 tokens: 40 tokens can never fit.
    reject(sched.add_request(1, &[1; 30], params(10)));
    sched.add_request(1, &[1, 2], params(4)).unwrap();
    assert!(matches!(
        sched.add_request(1, &[1, 2], params(4)),
        Err(CoreError::DuplicateRequest { id: 1 })
    ));
    assert_eq!(sched.num_requests(), 1);
    sched.check_integrity().unwrap();
}

#[test]
fn config_is_validated() {
    assert!(Scheduler::new(config(8, 4)).is_err()); // budget < max_num_seqs
    let cfg = SchedulerConfig {
        enable_chunked_prefill: false,
        ..config(8, 32)
    };
    assert!(Scheduler::new(cfg).is_err()); // budget < max_model_len
                                           // Recurrent state: a cached prefix cannot restore it, drafts would
                                           // leave rejected updates in it.
    let stateful = SchedulerConfig {
        num_state_slots: 4,
        ..config(8, 32)
    };
    assert!(Scheduler::new(stateful.clone()).is_err()); // prefix caching, no snapshots
    let with_snapshots = SchedulerConfig {
        num_state_snapshots: 2,
        ..stateful.clone()
    };
    Scheduler::new(with_snapshots).unwrap();
    let snapshots_alone = SchedulerConfig {
        num_state_snapshots: 2,
        num_state_slots: 0,
        ..stateful.clone()
    };
    assert!(Scheduler::new(snapshots_alone).is_err());
    let stateful = SchedulerConfig {
        enable_prefix_caching: false,
        ..stateful
    };
    Scheduler::new(stateful.clone()).unwrap();
    let speculating = SchedulerConfig {
        speculation: spec_config(SpecMethod::Ngram { min: 1, max: 3 }, 2, false),
        ..stateful
    };
    assert!(Scheduler::new(speculating).is_err());
}

#[test]
fn decodes_until_length_and_eos() {
    let prompt = [5, 6, 7];
    let (out, reason) = run_alone(&prompt, params(5));
    assert!(out.len() <= 5);
    if out.len() < 5 {
        assert_eq!((*out.last().unwrap(), reason), (EOS, FinishReason::Stop));
    } else {
        assert!(reason == FinishReason::Length || out[4] == EOS);
    }
    let (ignored, _) = run_alone(
        &prompt,
        RequestParams {
            ignore_eos: true,
            ..params(20)
        },
    );
    assert_eq!(ignored.len(), 20);
}

#[test]
fn min_tokens_and_stop_token_ids() {
    let prompt = [9, 9, 1];
    let (free_run, _) = run_alone(
        &prompt,
        RequestParams {
            ignore_eos: true,
            ..params(12)
        },
    );
    // Stop on the token produced third, but not before min_tokens.
    let stop = free_run[2];
    let p = RequestParams {
        stop_token_ids: vec![stop],
        ignore_eos: true,
        ..params(12)
    };
    let (out, reason) = run_alone(&prompt, p.clone());
    let first = free_run.iter().position(|&t| t == stop).unwrap();
    assert_eq!((out.len(), reason), (first + 1, FinishReason::Stop));
    let (out, _) = run_alone(&prompt, RequestParams { min_tokens: 8, ..p });
    assert!(out.len() >= 8);
}

#[test]
fn long_prompt_is_chunked_and_decodes_keep_running() {
    let cfg = config(64, 8);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    sched
        .add_request(
            1,
            &[3, 4],
            RequestParams {
                ignore_eos: true,
                ..params(20)
            },
        )
        .unwrap();
    let plan = sched.schedule().unwrap();
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
    sched.add_request(2, &[7; 30], params(4)).unwrap();
    let mut steps_with_decode = 0;
    while sched.request(2).unwrap().num_computed_tokens < 30 {
        let plan = sched.schedule().unwrap();
        assert!(plan.num_tokens() <= 8);
        assert_eq!(plan.req_ids[0], 1, "the decode runs first");
        steps_with_decode += 1;
        let out = model.run(&plan);
        sched.update(&plan, &out, &[], None).unwrap();
        sched.check_integrity().unwrap();
    }
    assert!(steps_with_decode >= 30 / 7);
}

#[test]
fn prefix_cache_hits_skip_computed_blocks() {
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let system: Vec<u32> = (1..=16).collect();
    let mut first = system.clone();
    first.extend([40, 41]);
    sched.add_request(1, &first, params(3)).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    let mut second = system.clone();
    second.extend([42, 43, 44]);
    sched.add_request(2, &second, params(3)).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens[0], 16);
    assert_eq!(plan.num_scheduled_tokens[0], 3);
    let stats = sched.stats();
    assert_eq!(stats.prefix_hit_tokens, 16);
    let sampled = model.run(&plan);
    sched.update(&plan, &sampled, &[], None).unwrap();
    let rest = drive(&mut sched, &mut model, |_, _| {});
    let mut got = vec![sampled[0]];
    got.extend(rest[&2].0.iter());
    assert_eq!(got, run_alone(&second, params(3)).0);
    assert_idle(&sched);
}

#[test]
fn concurrent_requests_share_a_prefilled_prompt() {
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prompt: Vec<u32> = (1..=13).collect();
    sched
        .add_request(
            1,
            &prompt,
            RequestParams {
                ignore_eos: true,
                ..params(30)
            },
        )
        .unwrap();
    let plan = sched.schedule().unwrap();
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
    // Request 1 is still decoding; its prompt blocks are already shared.
    sched.add_request(2, &prompt, params(2)).unwrap();
    let plan = sched.schedule().unwrap();
    let row = plan.req_ids.iter().position(|&id| id == 2).unwrap();
    assert_eq!(plan.num_computed_tokens[row], 12);
    sched.check_integrity().unwrap();
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
}

#[test]
fn a_fan_out_computes_its_shared_prefix_once() {
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prefix: Vec<u32> = (1..=12).collect(); // three full blocks
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| [prefix.clone(), vec![20 + i, 30 + i]].concat())
        .collect();
    for (i, prompt) in prompts.iter().enumerate() {
        sched.add_request(i as u64, prompt, params(3)).unwrap();
    }
    // The first computes the prefix; the others wait for it, though the
    // budget would fit them all.
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.req_ids.to_vec(), vec![0]);
    assert_eq!(sched.request(1).unwrap().num_prefix_wait_steps, 1);
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
    // Then they join with the prefix served by the cache.
    let plan = sched.schedule().unwrap();
    for id in 1..4u64 {
        let row = plan.req_ids.iter().position(|&r| r == id).unwrap();
        assert_eq!(plan.num_computed_tokens[row], 12, "request {id}");
    }
    let out = model.run(&plan);
    let events = sched.update(&plan, &out, &[], None).unwrap();
    let first: std::collections::HashMap<u64, u32> = (0..events.len())
        .map(|i| (events.req_ids[i], events.token_ids[i] as u32))
        .collect();
    let finished = drive(&mut sched, &mut model, |_, _| {});
    for (i, prompt) in prompts.iter().enumerate().skip(1) {
        let id = i as u64;
        let (rest, reason) = finished[&id].clone();
        assert_eq!(
            ([vec![first[&id]], rest].concat(), reason),
            run_alone(prompt, params(3))
        );
    }
    assert_idle(&sched);
}

#[test]
fn a_follower_waits_out_a_chunked_prefix_then_hits_it() {
    // The leader's 600-token prompt is computed in chunks of 16 tokens; a
    // request sharing it, arriving meanwhile, joins once the whole prompt is
    // in the cache. Past MAX_PREFIX_WAIT_STEPS it would stop waiting.
    let cfg = SchedulerConfig {
        max_model_len: 1024,
        max_num_seqs: 2,
        ..config(512, 16)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prompt: Vec<u32> = (0..600).map(|i| 1 + (i % 40) as u32).collect();
    let follower = [prompt.clone(), vec![7]].concat();
    sched.add_request(1, &prompt, params(2)).unwrap();
    let mut joined_with = None;
    let mut on_step = |s: &mut Scheduler, step: usize| {
        if step == 1 {
            s.add_request(2, &follower, params(2)).unwrap();
        }
        if let Some(r) = s.request(2) {
            assert!(r.num_prefix_wait_steps <= MAX_PREFIX_WAIT_STEPS);
            if r.status == RequestStatus::Running && joined_with.is_none() {
                joined_with = Some(r.num_prefix_hit_tokens);
            }
        }
    };
    let finished = drive_for(&mut sched, &mut model, 0, &mut on_step);
    assert_eq!(joined_with, Some(600));
    let solo_cfg = SchedulerConfig {
        enable_prefix_caching: false,
        ..cfg.clone()
    };
    let mut solo = Scheduler::new(solo_cfg.clone()).unwrap();
    solo.add_request(2, &follower, params(2)).unwrap();
    let alone = drive(&mut solo, &mut FakeModel::new(&solo_cfg), |_, _| {});
    assert_eq!(finished[&2], alone[&2]);
    assert_idle(&sched);

    let mut sched = Scheduler::new(cfg).unwrap();
    sched.add_request(1, &prompt, params(2)).unwrap();
    let plan = sched.schedule().unwrap();
    sched.update(&plan, &[], &[], None).unwrap();
    sched.add_request(2, &follower, params(2)).unwrap();
    let slot = sched.index[&2];
    let leaders = sched.prefix_leaders();
    assert!(sched.shared_prefix_leader(slot, 0, &leaders).is_some());
    sched.req_mut(slot).num_prefix_wait_steps = MAX_PREFIX_WAIT_STEPS;
    assert!(sched.shared_prefix_leader(slot, 0, &leaders).is_none());
}

#[test]
fn preemption_recomputes_and_prefers_latest_arrival() {
    // 5 blocks of 4 tokens: two requests growing to 11 computed tokens (3
    // blocks each) cannot both fit.
    let cfg = config(5, 32);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = RequestParams {
        ignore_eos: true,
        ..params(9)
    };
    sched.add_request(1, &[1, 2, 3], p.clone()).unwrap();
    sched.add_request(2, &[4, 5, 6], p.clone()).unwrap();
    let mut preempted = vec![];
    let mut steps = 0;
    let results = {
        let mut out = std::collections::HashMap::new();
        while sched.has_unfinished() {
            let plan = sched.schedule().unwrap();
            preempted.extend(plan.preempted_ids.iter().copied());
            let sampled = model.run(&plan);
            let ev = sched.update(&plan, &sampled, &[], None).unwrap();
            sched.check_integrity().unwrap();
            for i in 0..ev.len() {
                out.entry(ev.req_ids[i])
                    .or_insert_with(Vec::new)
                    .push(ev.token_ids[i] as u32);
            }
            steps += 1;
            assert!(steps < 200);
        }
        out
    };
    assert!(!preempted.is_empty());
    assert_eq!(preempted[0], 2, "the latest arrival goes first");
    assert!(sched.stats().num_preemptions >= 1);
    assert_eq!(results[&1], run_alone(&[1, 2, 3], p.clone()).0);
    assert_eq!(results[&2], run_alone(&[4, 5, 6], p).0);
    assert_idle(&sched);
}

#[test]
fn priority_policy_admits_and_preempts_by_priority() {
    let cfg = SchedulerConfig {
        num_blocks: 6,
        policy: Policy::Priority,
        ..config(6, 32)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = |priority| RequestParams {
        ignore_eos: true,
        priority,
        ..params(9)
    };
    sched.add_request(1, &[1; 8], p(5)).unwrap();
    let plan = sched.schedule().unwrap();
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    // Urgent request: needs blocks held by request 1.
    sched.add_request(2, &[2; 14], p(-1)).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.preempted_ids, vec![1]);
    assert_eq!(plan.req_ids, vec![2]);
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
}

#[test]
fn a_hit_copies_the_positions_a_cached_block_shares() {
    // Blocks of 4: [1..4] [5..8] cached; the next prompt shares [1..4] and
    // the first two tokens of [5..8]: a 4-token hit plus 2 positions copied
    // from the cached block, then its own tokens from position 6.
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    sched
        .add_request(1, &(1..=10).collect::<Vec<_>>(), params(2))
        .unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    let prompt = [1, 2, 3, 4, 5, 6, 40, 41, 42];
    sched.add_request(2, &prompt, params(3)).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![6]);
    assert_eq!(plan.kv_copy_src.len(), 2);
    let own = plan.block_table[1] as i64;
    assert_eq!(plan.kv_copy_dst, vec![own * 4, own * 4 + 1]);
    assert_ne!(plan.kv_copy_src[0] / 4, own);
    assert_eq!(sched.request(2).unwrap().num_prefix_hit_tokens, 6);
    sched.check_integrity().unwrap();
    let sampled = model.run(&plan);
    sched.update(&plan, &sampled, &[], None).unwrap();
    assert!(sched.request(2).unwrap().kv_copy.is_none());
    let mut out = vec![sampled[0]];
    let finished = drive(&mut sched, &mut model, |_, _| {});
    out.extend(&finished[&2].0);
    assert_eq!((out, finished[&2].1), run_alone(&prompt, params(3)));
    assert_idle(&sched);
}

/// The first step's request ids after a 12-token prompt was cached and two
/// requests queued behind it, the first of them without a cached prefix.
fn first_admitted_after_a_cached_prefix(policy: Policy) -> Vec<u64> {
    let cfg = SchedulerConfig {
        max_num_seqs: 1,
        policy,
        ..config(32, 32)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let cached: Vec<u32> = (1..=12).collect();
    sched.add_request(1, &cached, params(2)).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    sched.add_request(2, &[40; 10], params(2)).unwrap();
    let hit: Vec<u32> = cached.iter().copied().chain([30, 31]).collect();
    sched.add_request(3, &hit, params(2)).unwrap();
    let plan = sched.schedule().unwrap();
    let ids = plan.req_ids.clone();
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
    ids
}

#[test]
fn lpm_admits_the_longest_cached_prefix_first() {
    assert_eq!(first_admitted_after_a_cached_prefix(Policy::Fcfs), vec![2]);
    assert_eq!(first_admitted_after_a_cached_prefix(Policy::Lpm), vec![3]);
}

#[test]
fn lpm_serves_a_request_passed_over_for_too_long() {
    // One sequence at a time; a request without a cached prefix waits while
    // a stream of requests that hit the cache arrives, for at most
    // LPM_MAX_WAIT_STEPS steps (plus the running request's last steps).
    let cfg = SchedulerConfig {
        max_num_seqs: 1,
        policy: Policy::Lpm,
        ..config(32, 32)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let cached: Vec<u32> = (1..=12).collect();
    sched.add_request(1, &cached, params(2)).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    sched.add_request(2, &[40; 10], params(2)).unwrap();
    let mut next_id = 3;
    let mut admitted_at = None;
    for step in 0..200u64 {
        if sched.num_requests() < 3 {
            let prompt: Vec<u32> = cached
                .iter()
                .copied()
                .chain([30, 1 + next_id as u32 % 40])
                .collect();
            sched.add_request(next_id, &prompt, params(2)).unwrap();
            next_id += 1;
        }
        let plan = sched.schedule().unwrap();
        if plan.req_ids.contains(&2) && admitted_at.is_none() {
            admitted_at = Some(step);
        }
        sched.update(&plan, &model.run(&plan), &[], None).unwrap();
        sched.check_integrity().unwrap();
        if admitted_at.is_some() && step > admitted_at.unwrap() + 4 {
            break;
        }
    }
    let at = admitted_at.expect("the request without a hit was never served");
    assert!(
        at >= 4,
        "it was passed over for requests with hits (at {at})"
    );
    assert!(at <= LPM_MAX_WAIT_STEPS + 3, "it waited {at} steps");
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
}

#[test]
fn abort_in_every_state_returns_blocks() {
    let cfg = config(16, 8);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    sched.add_request(1, &[1; 20], params(8)).unwrap(); // chunked prefill
    sched.add_request(2, &[2; 3], params(8)).unwrap(); // waiting
    let plan = sched.schedule().unwrap();
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    assert!(sched.abort(2).unwrap());
    assert!(sched.abort(1).unwrap());
    assert!(
        !sched.abort(1).unwrap(),
        "unknown ids are flagged, not raised"
    );
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.aborted_ids, vec![2, 1]);
    sched.update(&plan, &[], &[], None).unwrap();
    assert_idle(&sched);
    // Aborted between schedule and update: the row is skipped.
    sched.add_request(3, &[3; 5], params(8)).unwrap();
    let plan = sched.schedule().unwrap();
    sched.abort(3).unwrap();
    let events = sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    assert!(events.is_empty());
    assert_idle(&sched);
}

#[test]
fn externally_finished_requests_end_with_stop() {
    let cfg = config(16, 32);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    sched
        .add_request(
            1,
            &[1, 2, 3],
            RequestParams {
                ignore_eos: true,
                ..params(8)
            },
        )
        .unwrap();
    sched
        .add_request(
            2,
            &[4, 5],
            RequestParams {
                ignore_eos: true,
                ..params(8)
            },
        )
        .unwrap();
    let plan = sched.schedule().unwrap();
    let ev = sched.update(&plan, &model.run(&plan), &[1], None).unwrap();
    let row = ev.req_ids.iter().position(|&id| id == 1).unwrap();
    assert_eq!(ev.finish_reasons[row], FinishReason::Stop as u8);
    assert!(ev.token_ids[row] >= 0);
    assert!(sched.request(1).is_none());
    assert!(sched.request(2).is_some());
    sched.check_integrity().unwrap();
}

#[test]
fn stale_plans_are_rejected() {
    let cfg = config(16, 32);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    sched.add_request(1, &[1, 2, 3], params(4)).unwrap();
    let plan = sched.schedule().unwrap();
    assert!(matches!(sched.schedule(), Err(CoreError::PlanMismatch(_))));
    assert!(sched.update(&plan, &[1, 2], &[], None).is_err());
    assert!(sched.update(&plan, &[VOCAB as u32], &[], None).is_err());
    sched.update(&plan, &[7], &[], None).unwrap();
    assert!(matches!(
        sched.update(&plan, &[7], &[], None),
        Err(CoreError::PlanMismatch(_))
    ));
    sched.check_integrity().unwrap();
}

// ---- random workloads against requests run alone ----------------------

#[derive(Debug, Clone)]
struct Workload {
    requests: Vec<(Vec<u32>, RequestParams, usize)>, // prompt, params, arrival step
    aborts: Vec<(usize, usize)>,                     // (step, request index)
}

fn policies() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Fcfs),
        Just(Policy::Priority),
        Just(Policy::Lpm)
    ]
}

fn workload() -> impl Strategy<Value = Workload> {
    let prefixes = prop::collection::vec(prop::collection::vec(1u32..VOCAB as u32, 0..12), 1..4);
    (
        prefixes,
        prop::collection::vec(
            (
                0usize..4,
                prop::collection::vec(1u32..VOCAB as u32, 1..10),
                1usize..12,
                any::<bool>(),
                0usize..12,
                -1i32..2,
                prop_oneof![2 => Just(0u32), 1 => 1u32..4],
            ),
            1..10,
        ),
        prop::collection::vec((0usize..30, 0usize..10), 0..3),
    )
        .prop_map(|(prefixes, reqs, aborts)| {
            let requests = reqs
                .into_iter()
                .map(
                    |(pi, suffix, max_tokens, ignore_eos, arrival, priority, adapter)| {
                        let mut prompt = prefixes[pi % prefixes.len()].clone();
                        prompt.extend(suffix);
                        let p = RequestParams {
                            max_tokens,
                            ignore_eos,
                            priority,
                            eos_token_ids: vec![EOS],
                            adapter,
                            ..RequestParams::default()
                        };
                        (prompt, p, arrival)
                    },
                )
                .collect();
            Workload { requests, aborts }
        })
}

/// Runs the workload; returns how many preemptions it caused.
fn check_workload(w: &Workload, cfg: SchedulerConfig) -> u64 {
    check_workload_with(w, cfg, None).num_preemptions
}

/// Runs the workload (with a draft model's stand-in, if given): every
/// request not aborted must end exactly as it does alone, without
/// speculation, and every block must come back. Returns the final counters.
fn check_workload_with(
    w: &Workload,
    cfg: SchedulerConfig,
    drafter: Option<Drafter<'_>>,
) -> crate::SchedulerStats {
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let mut aborted = std::collections::HashSet::new();
    let last_arrival = w.requests.iter().map(|r| r.2).max().unwrap_or(0);
    let mut on_step = |s: &mut Scheduler, step: usize| {
        for (i, (prompt, p, arrival)) in w.requests.iter().enumerate() {
            if *arrival == step {
                s.add_request(i as u64, prompt, p.clone()).unwrap();
            }
        }
        for &(at, i) in &w.aborts {
            if at == step && s.abort(i as u64).unwrap() {
                aborted.insert(i as u64);
            }
        }
    };
    let finished = drive_with(&mut sched, &mut model, last_arrival, &mut on_step, drafter);
    for (i, (prompt, p, _)) in w.requests.iter().enumerate() {
        let id = i as u64;
        if aborted.contains(&id) {
            assert!(!finished.contains_key(&id));
            continue;
        }
        let alone = run_alone_windowed(prompt, p.clone(), cfg.max_model_len, cfg.sliding_window);
        assert_eq!(finished[&id], alone, "request {id}");
    }
    assert_idle(&sched);
    sched.stats()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn random_workloads_match_isolated_runs(
        w in workload(),
        caching in any::<bool>(),
        tight_pool in any::<bool>(),
        policy in policies(),
        budget in 8usize..40,
        max_adapters in 1usize..4,
    ) {
        let num_blocks = if tight_pool { 8 } else { 128 };
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            policy,
            max_model_len: 28,
            max_adapters,
            ..config(num_blocks, budget)
        };
        check_workload(&w, cfg);
    }
}

#[test]
fn random_workloads_do_preempt() {
    // The property test above must exercise preemption, not only pass.
    let w = Workload {
        requests: (0..6)
            .map(|i| {
                (
                    vec![i + 1; 9],
                    RequestParams {
                        ignore_eos: true,
                        ..params(12)
                    },
                    0,
                )
            })
            .collect(),
        aborts: vec![],
    };
    let cfg = SchedulerConfig {
        max_model_len: 28,
        ..config(8, 16)
    };
    assert!(check_workload(&w, cfg) > 0);
}

#[test]
fn opting_out_of_the_prefix_cache_recomputes_the_prompt() {
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prompt: Vec<u32> = (1..=17).collect();
    sched.add_request(1, &prompt, params(2)).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    let p = RequestParams {
        use_prefix_cache: false,
        ..params(2)
    };
    sched.add_request(2, &prompt, p).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(
        (plan.num_computed_tokens[0], plan.num_scheduled_tokens[0]),
        (0, 17)
    );
    sched.check_integrity().unwrap();
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
}

#[test]
fn reset_prefix_cache_frees_unused_entries_only() {
    let cfg = config(64, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    sched
        .add_request(1, &(1..=20).collect::<Vec<_>>(), params(2))
        .unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    sched
        .add_request(
            2,
            &(1..=20).collect::<Vec<_>>(),
            RequestParams {
                ignore_eos: true,
                ..params(30)
            },
        )
        .unwrap();
    let plan = sched.schedule().unwrap();
    sched.update(&plan, &model.run(&plan), &[], None).unwrap();
    let cached = sched.stats().num_cached_blocks;
    assert!(cached > 0 || sched.cache().num_locked_blocks() > 0);
    let freed = sched.reset_prefix_cache().unwrap();
    assert_eq!(freed, cached, "only blocks no request holds are dropped");
    assert_eq!(sched.stats().num_cached_blocks, 0);
    assert!(
        sched.cache().num_locked_blocks() > 0,
        "request 2's prefix stays"
    );
    sched.check_integrity().unwrap();
}

// ---- speculative decoding ----------------------------------------------

/// A small deterministic generator for test-side choices.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// A draft model stand-in: each draft is the fake model's true next token
/// with probability `accept_percent`, else another token; written into the
/// plan as a draft model's proposals are.
fn oracle_drafter(
    seed: u64,
    accept_percent: u64,
) -> impl FnMut(&Scheduler, &mut BatchPlan) -> Vec<u32> {
    let mut rng = Lcg(seed);
    move |sched, plan| {
        let mut drafts = Vec::new();
        for row in 0..plan.num_reqs() {
            let d = plan.num_draft_tokens[row] as usize;
            if d == 0 {
                continue;
            }
            let mut context = sched.request(plan.req_ids[row]).unwrap().tokens.clone();
            let start = plan.query_start_loc[row] as usize + 1;
            for i in 0..d {
                let truth = FakeModel::token_of(&context, FakeModel::context_state(&context));
                let token = if rng.chance(accept_percent) {
                    truth
                } else {
                    (truth + 1 + rng.next() as u32 % (VOCAB as u32 - 1)) % VOCAB as u32
                };
                context.push(token);
                plan.input_ids[start + i] = token as i64;
                drafts.push(token);
            }
        }
        drafts
    }
}

fn spec_config(method: SpecMethod, num_tokens: usize, adaptive: bool) -> Option<SpecConfig> {
    Some(SpecConfig {
        method,
        num_tokens,
        adaptive,
        disable_by_batch_size: None,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]
    #[test]
    fn speculation_gives_the_outputs_of_plain_decoding(
        w in workload(),
        external in any::<bool>(),
        accept_percent in 0u64..101,
        seed in any::<u64>(),
        k in 1usize..7,
        lookup in (1usize..4, 0usize..3),
        adaptive in any::<bool>(),
        min_tokens in 0usize..6,
        caching in any::<bool>(),
        tight_pool in any::<bool>(),
        budget in 8usize..40,
        window in prop::option::of(1usize..8),
    ) {
        let mut w = w;
        for r in &mut w.requests {
            r.1.min_tokens = min_tokens;
        }
        let method = if external {
            SpecMethod::External
        } else {
            SpecMethod::Ngram { min: lookup.0, max: lookup.0 + lookup.1 }
        };
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            max_model_len: 28,
            speculation: spec_config(method, k, adaptive),
            // With windows, a window pool of 24 blocks (tight for 8 requests).
            sliding_window: window,
            num_window_blocks: if window.is_some() { 24 } else { 0 },
            ..config(if tight_pool { 8 } else { 128 }, budget)
        };
        let mut drafter = oracle_drafter(seed, accept_percent);
        let stats = check_workload_with(&w, cfg, external.then_some(&mut drafter as Drafter<'_>)).spec;
        prop_assert!(stats.num_accepted_tokens <= stats.num_draft_tokens);
        prop_assert_eq!(stats.accepted_lengths.iter().sum::<u64>(), stats.num_drafts);
    }
}

#[test]
fn speculation_is_exercised_and_accepts_by_pattern() {
    // The property test above must verify drafts, accept some and reject
    // some, and preempt in the middle of speculation.
    let w = Workload {
        requests: (0..6)
            .map(|i| {
                let p = RequestParams {
                    ignore_eos: true,
                    ..params(12)
                };
                (vec![i + 1; 9], p, 0)
            })
            .collect(),
        aborts: vec![(3, 2)],
    };
    for (accept_percent, tight) in [(100, false), (0, false), (60, true)] {
        let cfg = SchedulerConfig {
            max_model_len: 28,
            speculation: spec_config(SpecMethod::External, 4, false),
            ..config(if tight { 10 } else { 128 }, 32)
        };
        let mut drafter = oracle_drafter(7, accept_percent);
        let mut sched = Scheduler::new(cfg.clone()).unwrap();
        let stats = check_workload_with(&w, cfg.clone(), Some(&mut drafter)).spec;
        assert!(stats.num_drafts > 0);
        match accept_percent {
            100 => assert_eq!(stats.num_accepted_tokens, stats.num_draft_tokens),
            0 => assert_eq!(stats.num_accepted_tokens, 0),
            _ => {
                assert!(stats.num_accepted_tokens > 0);
                assert!(stats.num_accepted_tokens < stats.num_draft_tokens);
                // Preemptions happened with drafts in flight.
                sched = Scheduler::new(cfg).unwrap();
                let mut model = FakeModel::new(sched.config());
                for (i, (prompt, p, _)) in w.requests.iter().enumerate() {
                    sched.add_request(i as u64, prompt, p.clone()).unwrap();
                }
                let mut drafter = oracle_drafter(7, accept_percent);
                drive_with(
                    &mut sched,
                    &mut model,
                    0,
                    &mut |_, _| {},
                    Some(&mut drafter),
                );
                assert!(sched.stats().num_preemptions > 0);
            }
        }
        assert_idle(&sched);
    }
}

/// A model that repeats the last `period` tokens forever.
fn periodic_run(plan: &BatchPlan, tokens_of: impl Fn(u64) -> Vec<u32>, period: usize) -> Vec<u32> {
    plan.sample_rows
        .iter()
        .zip(&plan.logits_indices)
        .map(|(&row, &index)| {
            let row = row as usize;
            let mut context = tokens_of(plan.req_ids[row]);
            let pos = plan.positions[index as usize] as usize;
            let start = plan.query_start_loc[row] as usize;
            context.truncate(plan.num_computed_tokens[row] as usize);
            context.extend(
                plan.input_ids[start..=index as usize]
                    .iter()
                    .map(|&t| t as u32),
            );
            assert_eq!(context.len(), pos + 1);
            context[context.len() - period]
        })
        .collect()
}

#[test]
fn ngram_drafts_of_repeated_text_are_accepted_and_stop_rules_hold() {
    let cfg = SchedulerConfig {
        max_model_len: 64,
        speculation: spec_config(SpecMethod::Ngram { min: 1, max: 3 }, 5, false),
        ..config(64, 64)
    };
    let mut sched = Scheduler::new(cfg).unwrap();
    let prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4];
    sched
        .add_request(
            1,
            &prompt,
            RequestParams {
                max_tokens: 22,
                ..params(0)
            },
        )
        .unwrap();
    // A stop token inside a run of accepted drafts ends the request there.
    let stop = RequestParams {
        stop_token_ids: vec![6],
        min_tokens: 3,
        ..params(30)
    };
    sched.add_request(2, &prompt, stop).unwrap();
    let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut steps = 0;
    while sched.has_unfinished() {
        let plan = sched.schedule().unwrap();
        let tokens_of = |id| sched.request(id).unwrap().tokens.clone();
        let sampled = periodic_run(&plan, tokens_of, 4);
        let events = sched.update(&plan, &sampled, &[], None).unwrap();
        sched.check_integrity().unwrap();
        for i in 0..events.len() {
            outputs
                .entry(events.req_ids[i])
                .or_default()
                .push(events.token_ids[i] as u32);
        }
        steps += 1;
    }
    let cycle = [5, 6, 3, 4];
    let expect: Vec<u32> = (0..22).map(|i| cycle[i % 4]).collect();
    assert_eq!(outputs[&1], expect);
    // 6 at outputs 2 and 6: the first is before min_tokens.
    assert_eq!(outputs[&2], vec![5, 6, 3, 4, 5, 6]);
    assert!(steps <= 7, "{steps} steps for 22 tokens");
    let stats = sched.stats().spec;
    assert!(stats.num_accepted_tokens >= 15, "{stats:?}");
    assert_idle(&sched);
}

#[test]
fn drafts_respect_max_tokens_budget_and_batch_size() {
    let spec = SpecConfig {
        method: SpecMethod::External,
        num_tokens: 8,
        adaptive: false,
        disable_by_batch_size: Some(1),
    };
    let cfg = SchedulerConfig {
        speculation: Some(spec),
        ..config(64, 64)
    };
    let mut sched = Scheduler::new(cfg).unwrap();
    sched.add_request(1, &[1, 2, 3], params(4)).unwrap();
    let plan = sched.schedule().unwrap();
    sched.update(&plan, &[7], &[], None).unwrap();
    let plan = sched.schedule().unwrap();
    // Three output tokens left: two drafts and the token after them.
    assert_eq!(plan.num_draft_tokens, vec![2]);
    assert_eq!(plan.num_tokens(), 3);
    assert!(
        sched.update(&plan, &[1, 2, 3], &[], Some(&[9])).is_err(),
        "draft count"
    );
    let events = sched.update(&plan, &[1, 2, 3], &[], Some(&[1, 5])).unwrap();
    assert_eq!(
        events.token_ids,
        vec![1, 2],
        "the first draft kept, the second replaced"
    );
    assert_eq!(
        (events.verified_ids, events.num_drafted, events.num_accepted),
        (vec![1], vec![2], vec![1])
    );
    assert_eq!(sched.request(1).unwrap().num_computed_tokens, 5);
    // Two requests running: over disable_by_batch_size.
    let mut sched = Scheduler::new(sched.config().clone()).unwrap();
    sched.add_request(1, &[1, 2, 3], params(9)).unwrap();
    sched.add_request(2, &[1, 2, 4], params(9)).unwrap();
    for _ in 0..3 {
        let plan = sched.schedule().unwrap();
        assert_eq!(plan.num_drafts_total, 0);
        let out = vec![7; plan.sample_rows.len()];
        sched.update(&plan, &out, &[], None).unwrap();
    }
    sched.abort(2).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_drafts_total, 5, "alone again: 9 - 3 - 1 drafts");
}

// ---- sliding-window layers: a second pool ------------------------------

fn windowed(
    window: usize,
    num_blocks: usize,
    num_window_blocks: usize,
    budget: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        sliding_window: Some(window),
        num_window_blocks,
        ..config(num_blocks, budget)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn windowed_workloads_match_isolated_runs(
        w in workload(),
        caching in any::<bool>(),
        tight in 0usize..3,
        window in 1usize..10,
        budget in 8usize..24,
        policy in policies(),
    ) {
        // A tight pool of either kind makes requests preempt and evict.
        let (full, win) = [(128, 128), (8, 128), (128, 14)][tight];
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            policy,
            max_model_len: 28,
            ..windowed(window, full, win.max(windowed(window, 1, 1, budget).window_blocks_for(28)), budget)
        };
        check_workload(&w, cfg);
    }
}

#[test]
fn a_long_sequence_holds_only_its_window() {
    let cfg = SchedulerConfig {
        max_model_len: 200,
        ..windowed(6, 64, 8, 16)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = RequestParams {
        ignore_eos: true,
        ..params(150)
    };
    sched.add_request(1, &[5; 40], p.clone()).unwrap();
    let mut most = 0;
    let out = drive(&mut sched, &mut model, |s, _| {
        if let Some(r) = s.request(1) {
            let held = r.window_table.iter().filter(|&&b| b != NULL_BLOCK).count();
            most = most.max(held);
        }
    });
    assert_eq!(out[&1], run_alone_windowed(&[5; 40], p, 200, Some(6)));
    // 5 positions behind the next one and a 16-token chunk: at most 7 blocks.
    assert!(
        most <= cfg.window_blocks_for(190),
        "held {most} window blocks"
    );
    assert!(most >= 2);
    assert_idle(&sched);
}

#[test]
fn a_window_pool_too_small_for_one_request_rejects_it() {
    let cfg = windowed(16, 64, 3, 16);
    let mut sched = Scheduler::new(cfg).unwrap();
    let err = sched.add_request(1, &[1; 20], params(4)).unwrap_err();
    assert!(err.to_string().contains("window pool"), "{err}");
    assert!(Scheduler::new(windowed(0, 64, 8, 16)).is_err());
    assert!(Scheduler::new(SchedulerConfig {
        num_window_blocks: 4,
        ..config(64, 16)
    })
    .is_err());
}

#[test]
fn a_hit_needs_the_window_before_it_and_evicted_window_blocks_shorten_it() {
    // Window 4, blocks of 4: a hit at P needs the block holding P - 3.
    let cfg = windowed(4, 64, 16, 64);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prompt: Vec<u32> = (1..=21).collect();
    let p = params(1);
    sched.add_request(1, &prompt, p.clone()).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    // Everything computed went to the cache, the window blocks too (the
    // last one is held by nothing else, so all are evictable).
    assert_eq!(sched.cache().num_window_cached_blocks(), 5);
    sched.add_request(2, &prompt, p.clone()).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_computed_tokens, vec![20]);
    let sampled = model.run(&plan);
    sched.update(&plan, &sampled, &[], None).unwrap();
    sched.check_integrity().unwrap();
    // Evict every window block no one reads: a hit then has no window to
    // stand on, and recomputes.
    let freed = sched.reset_prefix_cache().unwrap();
    assert!(freed > 0);
    sched.add_request(3, &prompt, p.clone()).unwrap();
    let full_blocks = sched.cache().num_cached_blocks();
    assert_eq!(full_blocks, 0, "reset dropped the unlocked entries");
    let out = drive(&mut sched, &mut model, |_, _| {});
    assert_eq!(out[&3], run_alone_windowed(&prompt, p, 64, Some(4)));
    assert_idle(&sched);
}

#[test]
fn usable_window_prefix_stops_where_the_window_is_missing() {
    use crate::radix_cache::usable_window_prefix;
    let n = NULL_BLOCK;
    // Blocks of 4, window 5: a hit of k blocks reads block (4k - 4) / 4 = k - 1 on.
    assert_eq!(usable_window_prefix(&[1, 2, 3], 5, 4), 3);
    assert_eq!(usable_window_prefix(&[n, n, 3], 5, 4), 3);
    assert_eq!(usable_window_prefix(&[1, 2, n], 5, 4), 2);
    // Window 6 reads two blocks back from k = 2 on (4k - 5 .. 4k - 1).
    assert_eq!(usable_window_prefix(&[n, 2, 3], 6, 4), 3);
    assert_eq!(usable_window_prefix(&[1, n, 3], 6, 4), 1);
    assert_eq!(usable_window_prefix(&[], 6, 4), 0);
}

#[test]
fn adapters_beyond_max_wait_their_turn_and_never_starve() {
    let cfg = SchedulerConfig {
        max_adapters: 1,
        ..config(128, 32)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let with_adapter = |adapter: u32| RequestParams {
        max_tokens: 3,
        ignore_eos: true,
        adapter,
        ..RequestParams::default()
    };
    sched.add_request(0, &[1, 2, 3], with_adapter(1)).unwrap();
    sched.add_request(1, &[1, 2, 3], with_adapter(2)).unwrap();
    let mut admitted_at = None;
    // Adapter 1's requests keep arriving: adapter 2's waits a bounded time.
    let mut on_step = |s: &mut Scheduler, step: usize| {
        if step < 300 {
            s.add_request(100 + step as u64, &[4, 5, 6, 7], with_adapter(1))
                .unwrap();
        }
        if admitted_at.is_none() && s.request(1).map(|r| r.status) == Some(RequestStatus::Running) {
            admitted_at = Some(step);
        }
        assert!(s.running_adapters().len() <= 1);
    };
    let finished = drive_for(&mut sched, &mut model, 300, &mut on_step);
    let step = admitted_at.expect("adapter 2's request never ran");
    assert!(
        step <= MAX_ADAPTER_WAIT_STEPS as usize + 8,
        "adapter 2 waited {step} steps"
    );
    assert_eq!(finished[&1], run_alone(&[1, 2, 3], with_adapter(2)));
    assert_idle(&sched);
    let mut off = Scheduler::new(SchedulerConfig {
        max_adapters: 0,
        ..config(16, 16)
    })
    .unwrap();
    assert!(matches!(
        off.add_request(1, &[1], with_adapter(1)),
        Err(CoreError::RequestRejected { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]
    #[test]
    fn workloads_with_state_snapshots_match_isolated_runs(
        w in workload(),
        num_state_snapshots in 1usize..6,
        tight_pool in any::<bool>(),
        budget in 8usize..40,
        policy in policies(),
    ) {
        // Prefix hits resume from snapshots; outputs equal runs without any
        // cache, every slot, block and snapshot comes back.
        let cfg = SchedulerConfig {
            enable_prefix_caching: true,
            policy,
            num_state_snapshots,
            ..stateful(4, if tight_pool { 10 } else { 128 }, budget)
        };
        let stats = check_workload_with(&w, cfg, None);
        prop_assert_eq!(stats.num_free_state_slots, 4);
    }
}

#[test]
fn a_shared_prefix_resumes_from_its_snapshot_at_the_branch_point() {
    // A 12-token prefix (3 blocks) and three requests after it, one at a
    // time. The first saves its state at its own last full block (16); the
    // second finds the prefix's KV but no state there, recomputes, and saves
    // one at the branch point (12) and one at its 16; the third resumes from
    // the one at 12.
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        num_state_snapshots: 4,
        ..stateful(4, 64, 64)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prefix: Vec<u32> = (1..=12).collect();
    let mut hits = vec![];
    for (id, tail) in [
        [20u32, 21, 22, 23, 24, 25],
        [30, 31, 32, 33, 34, 35],
        [40, 41, 42, 43, 44, 45],
    ]
    .iter()
    .enumerate()
    {
        let prompt: Vec<u32> = prefix.iter().chain(tail).copied().collect();
        let p = RequestParams {
            ignore_eos: true,
            ..params(3)
        };
        sched.add_request(id as u64, &prompt, p.clone()).unwrap();
        let out = drive(&mut sched, &mut model, |_, _| {})
            .remove(&(id as u64))
            .unwrap();
        assert_eq!(out, run_alone(&prompt, p));
        hits.push(sched.stats().prefix_hit_tokens);
    }
    assert_eq!(hits, vec![0, 0, 12]);
    // At each prompt's 16th token, and at the branch point (12).
    assert_eq!(sched.stats().num_cached_state_snapshots, 4);
    assert_idle(&sched);
}

#[test]
fn a_fan_out_of_a_model_with_state_resumes_from_the_leaders_snapshot() {
    // Four requests arrive together with a 12-token shared prefix and 6
    // tokens of their own: the first computes the prefix and saves its state
    // where it ends (the followers wait for that; its own last full block
    // is at 16), the others resume there.
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        num_state_snapshots: 8,
        ..stateful(4, 64, 64)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = RequestParams {
        ignore_eos: true,
        ..params(3)
    };
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (1..=12).chain((0..6).map(|j| 20 + 6 * i + j)).collect())
        .collect();
    for (id, prompt) in prompts.iter().enumerate() {
        sched.add_request(id as u64, prompt, p.clone()).unwrap();
    }
    let finished = drive(&mut sched, &mut model, |_, _| {});
    for (id, prompt) in prompts.iter().enumerate() {
        assert_eq!(finished[&(id as u64)], run_alone(prompt, p.clone()));
    }
    assert_eq!(sched.stats().prefix_hit_tokens, 3 * 12);
    assert_idle(&sched);
}

#[test]
fn snapshots_are_evicted_least_recently_used_and_a_hit_falls_back() {
    // One snapshot only: each new prompt's save takes it from the last one,
    // whose hit then finds KV but no state (0 tokens) and recomputes.
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        num_state_snapshots: 1,
        ..stateful(2, 64, 64)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = RequestParams {
        ignore_eos: true,
        ..params(2)
    };
    let a: Vec<u32> = (1..=9).collect();
    let b: Vec<u32> = (11..=19).collect();
    for (id, prompt) in [(0u64, &a), (1, &b), (2, &a), (3, &b), (4, &b)] {
        sched.add_request(id, prompt, p.clone()).unwrap();
        let out = drive(&mut sched, &mut model, |_, _| {})
            .remove(&id)
            .unwrap();
        assert_eq!(out, run_alone(prompt, p.clone()), "request {id}");
    }
    // Only the last request (b again, right after b) found its snapshot.
    assert_eq!(sched.stats().prefix_hit_tokens, 8);
    assert_eq!(sched.stats().num_cached_state_snapshots, 1);
    assert_idle(&sched);
}

fn stateful(num_state_slots: usize, num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        enable_prefix_caching: false,
        num_state_slots,
        max_model_len: 28,
        ..config(num_blocks, budget)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn workloads_with_recurrent_state_match_isolated_runs(
        w in workload(),
        num_state_slots in 1usize..10,
        tight_pool in any::<bool>(),
        policy in policies(),
        budget in 8usize..40,
    ) {
        let cfg = SchedulerConfig {
            policy,
            ..stateful(num_state_slots, if tight_pool { 8 } else { 128 }, budget)
        };
        let stats = check_workload_with(&w, cfg, None);
        prop_assert_eq!(stats.num_free_state_slots, num_state_slots);
    }
}

#[test]
fn state_slots_bound_the_running_requests_and_come_back() {
    let cfg = stateful(2, 64, 32);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    for id in 0..5 {
        let p = RequestParams {
            ignore_eos: true,
            ..params(6)
        };
        sched.add_request(id, &[id as u32 + 1; 5], p).unwrap();
    }
    let mut most_running = 0;
    let finished = drive(&mut sched, &mut model, |s, step| {
        most_running = most_running.max(s.stats().num_running);
        if step == 3 {
            s.abort(4).unwrap(); // waiting: it holds no slot
        }
    });
    assert_eq!(most_running, 2);
    assert_eq!(finished.len(), 4);
    let stats = sched.stats();
    assert_eq!((stats.num_state_slots, stats.num_free_state_slots), (2, 2));
    // Aborting a running request gives its slot back.
    sched.add_request(9, &[3; 5], params(6)).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.state_slots.len(), 1);
    assert_eq!(sched.stats().num_free_state_slots, 1);
    sched.update(&plan, &[1], &[], None).unwrap();
    sched.abort(9).unwrap();
    sched.check_integrity().unwrap();
    assert_eq!(sched.stats().num_free_state_slots, 2);
}

#[test]
fn a_preempted_request_gives_its_state_slot_back_and_restarts_from_zero() {
    // 8 blocks of 4 tokens, 3 requests that grow to 16 tokens each: some are
    // preempted, and each resumes from a new, zeroed state (the fake model
    // panics on a state read before it was written, and its outputs then
    // differ from the request run alone).
    let w = Workload {
        requests: (0..3)
            .map(|i| {
                let p = RequestParams {
                    ignore_eos: true,
                    ..params(8)
                };
                (vec![i + 1; 8], p, 0)
            })
            .collect(),
        aborts: vec![],
    };
    let stats = check_workload_with(&w, stateful(3, 8, 16), None);
    assert!(stats.num_preemptions > 0);
    assert_eq!(stats.num_free_state_slots, 3);
}

// ---- atomic spans (an image computed in one chunk) ---------------------

#[test]
fn a_chunk_never_ends_inside_an_atomic_span() {
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        ..config(64, 8)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let p = RequestParams {
        atomic_spans: vec![(4, 10), (12, 19)],
        ..params(2)
    };
    sched.add_request(1, &[5; 24], p).unwrap();
    let mut chunks = Vec::new();
    while sched.request(1).unwrap().num_computed_tokens < 24 {
        let plan = sched.schedule().unwrap();
        chunks.push(plan.num_scheduled_tokens[0]);
        let out = model.run(&plan);
        sched.update(&plan, &out, &[], None).unwrap();
    }
    // 0..4 (8 tokens would end inside the first span), 4..12 (past it),
    // 12..20 (past the second), 20..24.
    assert_eq!(chunks, vec![4, 8, 8, 4]);
}

#[test]
fn a_prefix_hit_inside_an_atomic_span_runs_to_its_end() {
    let cfg = config(64, 8);
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let prompt: Vec<u32> = (1..=14).collect();
    let p = RequestParams {
        atomic_spans: vec![(6, 13)],
        ..params(1)
    };
    sched.add_request(1, &prompt, p.clone()).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    // The cache holds three full blocks (of 4 tokens): the hit ends at 12,
    // inside the span, whose cached part serves.
    sched.add_request(2, &prompt, p).unwrap();
    let plan = sched.schedule().unwrap();
    let (computed, scheduled) = (plan.num_computed_tokens[0], plan.num_scheduled_tokens[0]);
    assert_eq!(computed, 12);
    assert!(computed + scheduled >= 13);
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
}

#[test]
fn bad_atomic_spans_are_rejected() {
    let mut sched = Scheduler::new(config(64, 8)).unwrap();
    let with = |spans: Vec<(usize, usize)>| RequestParams {
        atomic_spans: spans,
        ..params(2)
    };
    for spans in [
        vec![(3, 3)],
        vec![(5, 4)],
        vec![(0, 11)],
        vec![(4, 6), (5, 7)],
        vec![(6, 8), (1, 3)],
        vec![(0, 9)], // longer than one step's budget
    ] {
        let r = sched.add_request(1, &[1; 10], with(spans.clone()));
        assert!(
            matches!(r, Err(CoreError::RequestRejected { .. })),
            "{spans:?}"
        );
    }
    sched.add_request(1, &[1; 10], with(vec![(0, 8)])).unwrap();
    let stateful = Scheduler::new(SchedulerConfig {
        num_state_slots: 2,
        num_state_snapshots: 4,
        ..config(64, 8)
    });
    let r = stateful
        .unwrap()
        .add_request(1, &[1; 10], with(vec![(2, 4)]));
    assert!(matches!(r, Err(CoreError::RequestRejected { .. })));
}

/// The workload's prompts with one or two random atomic spans each (of at
/// most `max_len` tokens).
fn with_atomic_spans(mut w: Workload, seeds: &[(usize, usize, bool)], max_len: usize) -> Workload {
    for (i, (prompt, p, _)) in w.requests.iter_mut().enumerate() {
        let (a, b, two) = seeds[i % seeds.len()];
        let n = prompt.len();
        let s = a % n;
        let e = s + 1 + b % max_len.min(n - s);
        p.atomic_spans = vec![(s, e)];
        if two && e + 1 < n {
            p.atomic_spans.push((e + 1, n.min(e + 1 + max_len)));
        }
    }
    w
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(80))]
    #[test]
    fn atomic_spans_hold_under_random_workloads(
        w in workload(),
        seeds in prop::collection::vec((0usize..64, 0usize..64, any::<bool>()), 1..6),
        caching in any::<bool>(),
        tight_pool in any::<bool>(),
        budget in 8usize..20,
    ) {
        let w = with_atomic_spans(w, &seeds, budget);
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            max_model_len: 28,
            ..config(if tight_pool { 8 } else { 128 }, budget)
        };
        let spans: std::collections::HashMap<u64, Vec<(usize, usize)>> = w
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u64, r.1.atomic_spans.clone()))
            .collect();
        let mut check = |_: &Scheduler, plan: &mut BatchPlan| {
            for row in plan.num_decodes..plan.num_reqs() {
                let end = (plan.num_computed_tokens[row] + plan.num_scheduled_tokens[row]) as usize;
                for &(s, e) in &spans[&plan.req_ids[row]] {
                    assert!(!(s < end && end < e), "a chunk ends at {end} inside [{s}, {e})");
                }
            }
            Vec::new()
        };
        check_workload_with(&w, cfg, Some(&mut check));
    }
}

// ---- the encoder budget (images encoded per step) ----------------------

#[test]
fn a_step_starts_images_within_its_encoder_budget() {
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        max_encoder_tokens_per_step: 10,
        ..config(64, 32)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let p = RequestParams {
        encoder_spans: vec![(2, 10)],
        ..params(2)
    };
    sched.add_request(1, &[5; 14], p.clone()).unwrap();
    sched.add_request(2, &[6; 14], p).unwrap();
    let plan = sched.schedule().unwrap();
    // The first image (8 rows) fits; the second would pass 10: its chunk
    // stops before it, though the token budget has room.
    assert_eq!(plan.num_scheduled_tokens, vec![14, 2]);
    let mut model = FakeModel::new(&cfg);
    let out = model.run(&plan);
    sched.update(&plan, &out, &[], None).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.req_ids, vec![1, 2]);
    assert_eq!(plan.num_scheduled_tokens, vec![1, 12]);
}

#[test]
fn an_image_larger_than_the_encoder_budget_runs_alone() {
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        max_encoder_tokens_per_step: 4,
        ..config(64, 32)
    };
    let mut sched = Scheduler::new(cfg).unwrap();
    let p = RequestParams {
        encoder_spans: vec![(1, 9), (10, 12)],
        ..params(2)
    };
    sched.add_request(1, &[5; 14], p).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.num_scheduled_tokens, vec![10]); // the 8-row image, then its next waits
    let bad = RequestParams {
        encoder_spans: vec![(4, 6), (5, 8)],
        ..params(2)
    };
    assert!(matches!(
        sched.add_request(2, &[5; 14], bad),
        Err(CoreError::RequestRejected { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(80))]
    #[test]
    fn encoder_budgets_hold_under_random_workloads(
        w in workload(),
        seeds in prop::collection::vec((0usize..64, 0usize..64, any::<bool>()), 1..6),
        caching in any::<bool>(),
        atomic in any::<bool>(),
        encoder_budget in 1usize..12,
    ) {
        let mut w = with_atomic_spans(w, &seeds, 8);
        for r in &mut w.requests {
            r.1.encoder_spans = r.1.atomic_spans.clone();
            if !atomic {
                r.1.atomic_spans.clear();
            }
        }
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            max_model_len: 28,
            max_encoder_tokens_per_step: encoder_budget,
            ..config(128, 16)
        };
        let spans: std::collections::HashMap<u64, Vec<(usize, usize)>> = w
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| (i as u64, r.1.encoder_spans.clone()))
            .collect();
        let mut check = |_: &Scheduler, plan: &mut BatchPlan| {
            let (mut started, mut cost) = (0, 0);
            for row in plan.num_decodes..plan.num_reqs() {
                let start = plan.num_computed_tokens[row] as usize;
                let end = start + plan.num_scheduled_tokens[row] as usize;
                for &(s, e) in &spans[&plan.req_ids[row]] {
                    if start <= s && s < end {
                        started += 1;
                        cost += e - s;
                    }
                }
            }
            assert!(cost <= encoder_budget || started == 1, "{started} images, {cost} rows");
            Vec::new()
        };
        check_workload_with(&w, cfg, Some(&mut check));
    }
}
