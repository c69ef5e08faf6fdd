//! Applying a step's sampled tokens: computed counts, new tokens, stop
//! rules, and the end of finished requests.

use rustc_hash::FxHashSet;

use crate::error::{CoreError, Result};
use crate::plan::{BatchPlan, StepEvents};
use crate::request::{FinishReason, Request, RequestStatus};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Applies a step's results: advances computed counts, appends sampled
    /// tokens (one per `plan.logits_indices` entry), finishes requests on
    /// EOS / stop token ids / length, and finishes the requests the caller
    /// stopped (a stop string matched). Rows of requests aborted since the
    /// plan was made are skipped.
    ///
    /// A row with drafts sampled each of its `1 + d` positions: its tokens
    /// are the samples up to and including the first that differs from its
    /// draft, each checked against the stop rules in turn; its KV beyond
    /// them is given up (rewritten by later steps, never cached).
    /// `drafts`: the caller's draft tokens, rows in order, for a plan whose
    /// drafts the caller proposed (None: the scheduler's own).
    pub fn update(
        &mut self,
        plan: &BatchPlan,
        sampled: &[u32],
        finished_externally: &[u64],
        drafts: Option<&[u32]>,
    ) -> Result<StepEvents> {
        if self.outstanding_step != Some(plan.step_id) {
            return Err(CoreError::PlanMismatch(format!(
                "plan of step {} is not the step awaiting update ({:?})",
                plan.step_id, self.outstanding_step
            )));
        }
        if sampled.len() != plan.sample_rows.len() {
            return Err(CoreError::InvalidArgument(format!(
                "expected {} sampled tokens (one per logits index), got {}",
                plan.sample_rows.len(),
                sampled.len()
            )));
        }
        let drafts = drafts.unwrap_or(&plan.draft_tokens);
        if drafts.len() != plan.num_drafts_total {
            return Err(CoreError::InvalidArgument(format!(
                "expected {} draft tokens, got {}",
                plan.num_drafts_total,
                drafts.len()
            )));
        }
        let vocab = self.config.vocab_size;
        if let Some(&bad) = sampled.iter().chain(drafts).find(|&&t| t as usize >= vocab) {
            return Err(CoreError::InvalidArgument(format!(
                "sampled or draft token {bad} is outside the vocabulary [0, {vocab})"
            )));
        }
        self.outstanding_step = None;
        let stopped: FxHashSet<u64> = finished_externally.iter().copied().collect();
        let mut events = StepEvents::default();
        let (mut cursor, mut draft_cursor) = (0, 0);
        for row in 0..plan.num_reqs() {
            let d = plan.num_draft_tokens[row] as usize;
            let num_samples = if plan.sample_rows.get(cursor) == Some(&(row as i32)) {
                1 + d
            } else {
                0
            };
            let samples = &sampled[cursor..cursor + num_samples];
            let row_drafts = &drafts[draft_cursor..draft_cursor + d];
            cursor += num_samples;
            draft_cursor += d;
            let slot = plan.slots[row];
            let live = matches!(self.slots.get(slot), Some(Some(r)) if r.id == plan.req_ids[row]
                && r.status == RequestStatus::Running);
            if !live {
                continue;
            }
            let n = plan.num_scheduled_tokens[row] as usize;
            let req = self.req_mut(slot);
            req.restore_from = None;
            req.kv_copy = None;
            if d == 0 {
                let req = self.req_mut(slot);
                req.num_computed_tokens += n;
                let computed = req.num_computed_tokens;
                req.snapshot_boundaries.retain(|&b| b > computed);
                let saves = std::mem::take(&mut self.req_mut(slot).pending_saves);
                if (n > 1 || !saves.is_empty()) && self.config.enable_prefix_caching {
                    self.share_computed_blocks(slot)?;
                }
                self.attach_snapshots(slot, saves)?;
                self.drop_behind_window(slot)?;
                if let Some(&token) = samples.first() {
                    self.append(slot, token, &stopped, &mut events)?;
                }
                continue;
            }
            let accepted = samples
                .iter()
                .zip(row_drafts)
                .take_while(|(s, d)| s == d)
                .count();
            self.spec_stats.record(d, accepted);
            let req = self.req_mut(slot);
            req.spec.observe(d, accepted);
            events.verified_ids.push(req.id);
            events.num_drafted.push(d as u32);
            events.num_accepted.push(accepted as u32);
            req.draft.clear();
            let mut finished = false;
            for &token in &samples[..=accepted] {
                // Everything before the new token is computed.
                let req = self.req_mut(slot);
                req.num_computed_tokens = req.num_tokens();
                if self.append(slot, token, &stopped, &mut events)? {
                    finished = true;
                    break;
                }
            }
            if !finished {
                if self.config.enable_prefix_caching {
                    self.share_computed_blocks(slot)?;
                }
                self.drop_behind_window(slot)?;
            }
        }
        for &id in finished_externally {
            if let Some(&slot) = self.index.get(&id) {
                self.remove_request(slot)?;
                events.push(id, None, Some(FinishReason::Stop));
            }
        }
        Ok(events)
    }

    /// Hands the snapshots a step wrote for the request to the prefix cache,
    /// at the boundaries they hold the state after (their blocks are
    /// cached by now).
    fn attach_snapshots(&mut self, slot: usize, saves: Vec<(u32, usize)>) -> Result<()> {
        if saves.is_empty() {
            return Ok(());
        }
        let req = self.slots[slot].as_ref().expect("live slot");
        let ns = req.params.adapter as u64;
        for (id, end) in saves {
            self.cache.attach_snapshot(ns, &req.tokens[..end], id)?;
        }
        Ok(())
    }

    /// Appends a sampled token to a running request and applies the stop
    /// rules; returns whether it finished (and was removed).
    fn append(
        &mut self,
        slot: usize,
        token: u32,
        stopped: &FxHashSet<u64>,
        events: &mut StepEvents,
    ) -> Result<bool> {
        let max_model_len = self.config.max_model_len;
        let req = self.req_mut(slot);
        req.tokens.push(token);
        let reason = finish_reason(req, token, stopped.contains(&req.id), max_model_len);
        events.push(req.id, Some(token), reason);
        if reason.is_some() {
            self.remove_request(slot)?;
        }
        Ok(reason.is_some())
    }
}

/// Stop rules after appending `token`: stop token ids and EOS (not before
/// `min_tokens`), a stop the caller found (a stop string), then
/// `max_tokens`, then `max_model_len`.
fn finish_reason(
    req: &Request,
    token: u32,
    stopped_externally: bool,
    max_model_len: usize,
) -> Option<FinishReason> {
    let p = &req.params;
    let num_out = req.num_output_tokens();
    let may_stop = num_out >= p.min_tokens;
    if stopped_externally
        || (may_stop
            && (p.stop_token_ids.contains(&token)
                || (!p.ignore_eos && p.eos_token_ids.contains(&token))))
    {
        return Some(FinishReason::Stop);
    }
    if num_out >= p.max_tokens || req.num_tokens() >= max_model_len {
        return Some(FinishReason::Length);
    }
    None
}
