//! Speculative decoding in the scheduler: n-gram proposals over a request's
//! own tokens, the choice of each request's draft length, and the counters.
//!
//! A step verifies a request's drafts as one chunk of `1 + d` positions: the
//! pending token, then the drafts. The runner samples every position from the
//! target model as if the drafts were the output so far; `update` keeps the
//! samples up to the first one that differs from its draft (that one too).
//! For proposals that are single tokens (n-gram, a draft model's argmax)
//! this is exact rejection sampling: a draft is kept with the target's
//! probability of it, and a rejected position's sample follows the target
//! distribution without the draft.

use crate::config::MAX_SPECULATIVE_TOKENS;

/// Steps a request that stopped speculating waits before it tries one draft
/// token again, so that its acceptance estimate can recover.
pub const PROBE_INTERVAL: u32 = 16;
/// Weight of one verified position in a request's acceptance estimate.
const ACCEPT_RATE_WEIGHT: f32 = 0.2;
/// The acceptance estimate before any verification.
pub const INITIAL_ACCEPT_RATE: f32 = 0.6;
/// Weight of one verified position in the engine-wide acceptance estimate,
/// which a new request starts from.
const GLOBAL_ACCEPT_RATE_WEIGHT: f32 = 0.02;
/// A draft position must be expected to return this many times its modelled
/// cost: the linear step-cost model underprices verification positions in
/// large batches (measured at 16-32 streams, `benches/speculative.py`).
pub const COST_MARGIN: f64 = 1.5;

/// The tokens that followed the latest earlier occurrence of the last `n`
/// tokens of `tokens`, for the longest `n` in `[min_n, max_n]` that occurs;
/// at most `k` of them (empty when nothing matches).
pub fn ngram_proposal(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 {
        return &[];
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        let last = suffix[n - 1];
        // Candidate ends: positions before the suffix's own end holding its
        // last token, latest first.
        for end in (n..len).rev() {
            if tokens[end - 1] == last && &tokens[end - n..end] == suffix {
                let stop = (end + k).min(len);
                return &tokens[end..stop];
            }
        }
    }
    &[]
}

/// The step-time model `update` learns nothing of: seconds per step and per
/// token, measured by the engine and set with `Scheduler::set_spec_cost`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecCost {
    /// Seconds of a step whatever its size.
    pub step_seconds: f64,
    /// Seconds each token adds to a step.
    pub token_seconds: f64,
    /// Seconds each draft token costs to propose (0 for n-gram).
    pub draft_seconds: f64,
}

impl Default for SpecCost {
    /// Until measured: tokens cost nothing next to the step, so speculate.
    fn default() -> Self {
        Self {
            step_seconds: 1.0,
            token_seconds: 0.0,
            draft_seconds: 0.0,
        }
    }
}

impl SpecCost {
    /// The acceptance probability a draft position needs to pay for itself
    /// (with `COST_MARGIN`) in a step with `num_decodes` decoding requests: a
    /// position costs `token + draft` seconds and yields its acceptance
    /// probability in tokens, against `num_decodes` tokens per
    /// `step + token * num_decodes` seconds without it.
    pub fn threshold(&self, num_decodes: usize) -> f64 {
        let n = num_decodes.max(1) as f64;
        let per_position = self.token_seconds + self.draft_seconds;
        let step = self.step_seconds + self.token_seconds * n;
        if step <= 0.0 {
            return 0.0;
        }
        (COST_MARGIN * per_position * n / step).max(0.0)
    }
}

/// A request's speculation state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecState {
    /// Estimated probability that a draft token is accepted, given that the
    /// ones before it were.
    pub accept_rate: f32,
    /// Steps since the request last speculated while it had a proposal.
    pub steps_without: u32,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
}

impl Default for SpecState {
    fn default() -> Self {
        Self::starting_at(INITIAL_ACCEPT_RATE)
    }
}

impl SpecState {
    /// A new request's state, from the acceptance recently seen engine-wide.
    pub fn starting_at(accept_rate: f32) -> Self {
        Self {
            accept_rate,
            steps_without: 0,
            num_draft_tokens: 0,
            num_accepted_tokens: 0,
        }
    }

    /// How many of `available` draft tokens to verify: the longest prefix
    /// whose every position is accepted with probability at least
    /// `threshold` (`accept_rate^j`); when that is none, one token every
    /// `PROBE_INTERVAL` steps, unless not even a sure draft would pay
    /// (threshold >= 1).
    pub fn draft_length(&mut self, available: usize, threshold: f64) -> usize {
        if available == 0 {
            return 0;
        }
        let rate = self.accept_rate as f64;
        let mut len = 0;
        let mut p = 1.0;
        while len < available {
            p *= rate;
            if p < threshold {
                break;
            }
            len += 1;
        }
        if len == 0 && threshold < 1.0 {
            self.steps_without += 1;
            if self.steps_without >= PROBE_INTERVAL {
                self.steps_without = 0;
                len = 1;
            }
        } else {
            self.steps_without = 0;
        }
        len
    }

    /// Learns from a verification of `drafted` tokens of which the first
    /// `accepted` were kept.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        learn(&mut self.accept_rate, ACCEPT_RATE_WEIGHT, drafted, accepted);
    }
}

/// Moves an acceptance estimate toward a verification's outcome: positions
/// kept count 1, the first refused 0 (the ones after it were not tried).
fn learn(rate: &mut f32, weight: f32, drafted: usize, accepted: usize) {
    let trials = (accepted + 1).min(drafted);
    for i in 0..trials {
        let kept = if i < accepted { 1.0 } else { 0.0 };
        *rate += weight * (kept - *rate);
    }
}

/// Counters of every verification so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecStats {
    /// Requests verified (one per request and step that speculated).
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// [a]: verifications that kept exactly `a` draft tokens.
    pub accepted_lengths: [u64; MAX_SPECULATIVE_TOKENS + 1],
    /// [i]: draft tokens accepted at position i.
    pub accepted_per_position: [u64; MAX_SPECULATIVE_TOKENS],
    /// Engine-wide acceptance estimate (per position), a new request's start.
    pub accept_rate: f32,
}

impl Default for SpecStats {
    fn default() -> Self {
        Self {
            num_drafts: 0,
            num_draft_tokens: 0,
            num_accepted_tokens: 0,
            accepted_lengths: [0; MAX_SPECULATIVE_TOKENS + 1],
            accepted_per_position: [0; MAX_SPECULATIVE_TOKENS],
            accept_rate: INITIAL_ACCEPT_RATE,
        }
    }
}

impl SpecStats {
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        learn(
            &mut self.accept_rate,
            GLOBAL_ACCEPT_RATE_WEIGHT,
            drafted,
            accepted,
        );
        self.num_drafts += 1;
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        self.accepted_lengths[accepted] += 1;
        for slot in &mut self.accepted_per_position[..accepted] {
            *slot += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_finds_the_latest_longest_match() {
        let t = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3];
        // "2 3" last occurred before "5 7".
        assert_eq!(ngram_proposal(&t, 1, 3, 2), &[5, 7]);
        assert_eq!(ngram_proposal(&t, 1, 3, 5), &[5, 7, 2, 3]);
        assert_eq!(ngram_proposal(&t, 3, 3, 5), &[] as &[u32]);
        // A longer match wins over a later shorter one.
        let t = [7, 8, 9, 1, 5, 9, 0, 8, 9];
        assert_eq!(ngram_proposal(&t, 1, 2, 1), &[1]);
        assert_eq!(ngram_proposal(&t, 1, 1, 1), &[0]);
        assert_eq!(ngram_proposal(&[4], 1, 3, 3), &[] as &[u32]);
        assert_eq!(ngram_proposal(&[4, 4], 1, 3, 3), &[4]);
        assert_eq!(ngram_proposal(&t, 1, 2, 0), &[] as &[u32]);
    }

    #[test]
    fn draft_length_follows_acceptance_and_cost() {
        let mut s = SpecState::default();
        assert_eq!(s.draft_length(5, 0.0), 5);
        assert_eq!(s.draft_length(3, 0.0), 3);
        s.accept_rate = 0.8;
        // 0.8, 0.64, 0.512, 0.41 -> three positions reach 0.5.
        assert_eq!(s.draft_length(5, 0.5), 3);
        s.accept_rate = 0.1;
        for _ in 1..PROBE_INTERVAL {
            assert_eq!(s.draft_length(5, 0.5), 0);
        }
        assert_eq!(
            s.draft_length(5, 0.5),
            1,
            "a probe after PROBE_INTERVAL steps"
        );
        assert_eq!(s.draft_length(0, 0.0), 0);
    }

    #[test]
    fn acceptance_estimate_moves_with_outcomes() {
        let mut s = SpecState::default();
        for _ in 0..50 {
            s.observe(4, 4);
        }
        assert!(s.accept_rate > 0.95);
        for _ in 0..50 {
            s.observe(4, 0);
        }
        assert!(s.accept_rate < 0.05);
        assert_eq!(s.num_draft_tokens, 400);
        assert_eq!(s.num_accepted_tokens, 200);
    }

    #[test]
    fn threshold_grows_with_the_batch() {
        let cost = SpecCost {
            step_seconds: 0.030,
            token_seconds: 0.001,
            draft_seconds: 0.0,
        };
        let one = cost.threshold(1);
        let many = cost.threshold(64);
        assert!(one < 0.06 && many > 0.9, "{one} {many}");
        assert_eq!(SpecCost::default().threshold(100), 0.0);
    }
}
