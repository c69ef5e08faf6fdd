use super::*;
use crate::{BatchPlan, FinishReason, RequestParams, SchedulerConfig};
use proptest::prelude::*;

const VOCAB: usize = 50;
const EOS: u32 = 0;

fn config(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        vocab_size: VOCAB,
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
/// prefix-cache hit changes the tokens it produces.
struct FakeModel {
    kv: Vec<Option<(u32, i64)>>,
    block_size: usize,
}

impl FakeModel {
    fn new(cfg: &SchedulerConfig) -> Self {
        Self {
            kv: vec![None; cfg.num_blocks * cfg.block_size],
            block_size: cfg.block_size,
        }
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
        for (i, (&slot, &tok)) in plan.slot_mapping.iter().zip(&plan.input_ids).enumerate() {
            self.kv[slot as usize] = Some((tok as u32, plan.positions[i]));
        }
        let mut out = vec![];
        for &row in &plan.sample_rows {
            let row = row as usize;
            let seq_len = plan.seq_lens[row] as usize;
            let table = &plan.block_table[row * plan.block_table_width..];
            let context: Vec<u32> = (0..seq_len)
                .map(|p| {
                    let slot = table[p / bs] as usize * bs + p % bs;
                    let (tok, pos) = self.kv[slot].expect("context slot was never written");
                    assert_eq!(pos, p as i64, "slot holds another position");
                    tok
                })
                .collect();
            out.push(Self::next_token(&context));
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
    let cfg = sched.config().clone();
    let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut finished = std::collections::HashMap::new();
    for step in 0..10_000 {
        on_step(sched, step);
        if !sched.has_unfinished() && step >= min_steps {
            break;
        }
        let plan = sched.schedule().unwrap();
        check_plan(&plan, &cfg);
        sched.check_integrity().unwrap();
        let sampled = model.run(&plan);
        let events = sched.update(&plan, &sampled, &[]).unwrap();
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
    let cfg = SchedulerConfig {
        enable_prefix_caching: false,
        max_model_len,
        ..config(64, 64)
    };
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
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
    sched.update(&plan, &out, &[]).unwrap();
    sched.add_request(2, &[7; 30], params(4)).unwrap();
    let mut steps_with_decode = 0;
    while sched.request(2).unwrap().num_computed_tokens < 30 {
        let plan = sched.schedule().unwrap();
        assert!(plan.num_tokens() <= 8);
        assert_eq!(plan.req_ids[0], 1, "the decode runs first");
        steps_with_decode += 1;
        let out = model.run(&plan);
        sched.update(&plan, &out, &[]).unwrap();
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
    sched.update(&plan, &sampled, &[]).unwrap();
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
    sched.update(&plan, &out, &[]).unwrap();
    // Request 1 is still decoding; its prompt blocks are already shared.
    sched.add_request(2, &prompt, params(2)).unwrap();
    let plan = sched.schedule().unwrap();
    let row = plan.req_ids.iter().position(|&id| id == 2).unwrap();
    assert_eq!(plan.num_computed_tokens[row], 12);
    sched.check_integrity().unwrap();
    let out = model.run(&plan);
    sched.update(&plan, &out, &[]).unwrap();
    drive(&mut sched, &mut model, |_, _| {});
    assert_idle(&sched);
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
            let ev = sched.update(&plan, &sampled, &[]).unwrap();
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
    sched.update(&plan, &model.run(&plan), &[]).unwrap();
    // Urgent request: needs blocks held by request 1.
    sched.add_request(2, &[2; 14], p(-1)).unwrap();
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.preempted_ids, vec![1]);
    assert_eq!(plan.req_ids, vec![2]);
    sched.update(&plan, &model.run(&plan), &[]).unwrap();
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
    sched.update(&plan, &model.run(&plan), &[]).unwrap();
    assert!(sched.abort(2).unwrap());
    assert!(sched.abort(1).unwrap());
    assert!(
        !sched.abort(1).unwrap(),
        "unknown ids are flagged, not raised"
    );
    let plan = sched.schedule().unwrap();
    assert_eq!(plan.aborted_ids, vec![2, 1]);
    sched.update(&plan, &[], &[]).unwrap();
    assert_idle(&sched);
    // Aborted between schedule and update: the row is skipped.
    sched.add_request(3, &[3; 5], params(8)).unwrap();
    let plan = sched.schedule().unwrap();
    sched.abort(3).unwrap();
    let events = sched.update(&plan, &model.run(&plan), &[]).unwrap();
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
    let ev = sched.update(&plan, &model.run(&plan), &[1]).unwrap();
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
    assert!(sched.update(&plan, &[1, 2], &[]).is_err());
    assert!(sched.update(&plan, &[VOCAB as u32], &[]).is_err());
    sched.update(&plan, &[7], &[]).unwrap();
    assert!(matches!(
        sched.update(&plan, &[7], &[]),
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
            ),
            1..10,
        ),
        prop::collection::vec((0usize..30, 0usize..10), 0..3),
    )
        .prop_map(|(prefixes, reqs, aborts)| {
            let requests = reqs
                .into_iter()
                .map(|(pi, suffix, max_tokens, ignore_eos, arrival, priority)| {
                    let mut prompt = prefixes[pi % prefixes.len()].clone();
                    prompt.extend(suffix);
                    let p = RequestParams {
                        max_tokens,
                        ignore_eos,
                        priority,
                        eos_token_ids: vec![EOS],
                        ..RequestParams::default()
                    };
                    (prompt, p, arrival)
                })
                .collect();
            Workload { requests, aborts }
        })
}

/// Runs the workload; returns how many preemptions it caused.
fn check_workload(w: &Workload, cfg: SchedulerConfig) -> u64 {
    let mut sched = Scheduler::new(cfg.clone()).unwrap();
    let mut model = FakeModel::new(&cfg);
    let mut aborted = std::collections::HashSet::new();
    let last_arrival = w.requests.iter().map(|r| r.2).max().unwrap_or(0);
    let finished = drive_for(&mut sched, &mut model, last_arrival, &mut |s, step| {
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
    });
    for (i, (prompt, p, _)) in w.requests.iter().enumerate() {
        let id = i as u64;
        if aborted.contains(&id) {
            assert!(!finished.contains_key(&id));
            continue;
        }
        let alone = run_alone_within(prompt, p.clone(), cfg.max_model_len);
        assert_eq!(finished[&id], alone, "request {id}");
    }
    assert_idle(&sched);
    sched.stats().num_preemptions
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn random_workloads_match_isolated_runs(
        w in workload(),
        caching in any::<bool>(),
        tight_pool in any::<bool>(),
        priority in any::<bool>(),
        budget in 8usize..40,
    ) {
        let num_blocks = if tight_pool { 8 } else { 128 };
        let cfg = SchedulerConfig {
            enable_prefix_caching: caching,
            policy: if priority { Policy::Priority } else { Policy::Fcfs },
            max_model_len: 28,
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
    sched.update(&plan, &model.run(&plan), &[]).unwrap();
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
    sched.update(&plan, &model.run(&plan), &[]).unwrap();
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
