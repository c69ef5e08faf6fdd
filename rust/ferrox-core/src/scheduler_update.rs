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
    pub fn update(
        &mut self,
        plan: &BatchPlan,
        sampled: &[u32],
        finished_externally: &[u64],
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
        if let Some(&bad) = sampled
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(CoreError::InvalidArgument(format!(
                "sampled token {bad} is outside the vocabulary [0, {})",
                self.config.vocab_size
            )));
        }
        self.outstanding_step = None;
        let live = |s: &Self, row: usize| -> bool {
            let slot = plan.slots[row];
            matches!(s.slots.get(slot), Some(Some(r)) if r.id == plan.req_ids[row]
                && r.status == RequestStatus::Running)
        };
        for row in 0..plan.num_reqs() {
            if !live(self, row) {
                continue;
            }
            let slot = plan.slots[row];
            let n = plan.num_scheduled_tokens[row] as usize;
            self.req_mut(slot).num_computed_tokens += n;
            if n > 1 && self.config.enable_prefix_caching {
                self.share_computed_blocks(slot)?;
            }
        }
        let stopped: FxHashSet<u64> = finished_externally.iter().copied().collect();
        let mut events = StepEvents::default();
        for (&row, &token) in plan.sample_rows.iter().zip(sampled) {
            let row = row as usize;
            if !live(self, row) {
                continue;
            }
            let slot = plan.slots[row];
            let max_model_len = self.config.max_model_len;
            let req = self.req_mut(slot);
            req.tokens.push(token);
            let reason = finish_reason(req, token, stopped.contains(&req.id), max_model_len);
            events.push(req.id, Some(token), reason);
            if reason.is_some() {
                self.remove_request(slot)?;
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
