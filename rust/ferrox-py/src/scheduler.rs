//! `ferrox._native.Scheduler` and the plan / event objects it hands out.

use ferrox_core::{
    BatchPlan, Policy, RequestParams, RequestStatus, Scheduler, SchedulerConfig, SchedulerStats,
    SpecConfig, SpecCost, SpecMethod, StepEvents, NULL_BLOCK,
};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{extract_ids, extract_u64s};
use crate::errors::{invalid_argument, OrRaise};

fn as_i64(ids: &[u64]) -> Vec<i64> {
    ids.iter().map(|&id| id as i64).collect()
}

/// One step's flat arrays (numpy, owned by this object). Rows with one
/// scheduled token (decodes) come first.
#[pyclass(name = "BatchPlan", module = "ferrox._native", frozen)]
pub struct PyBatchPlan {
    /// The core plan, minus the token-sized arrays moved into numpy.
    core: BatchPlan,
    #[pyo3(get)]
    step_id: u64,
    #[pyo3(get)]
    num_reqs: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    num_decodes: usize,
    /// Draft tokens in the plan (0: no row speculates).
    #[pyo3(get)]
    num_drafts_total: usize,
    #[pyo3(get)]
    req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    num_scheduled_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    num_computed_tokens: Py<PyArray1<i32>>,
    /// [B] draft tokens each row verifies (its last positions).
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    /// [B] the LoRA adapter of each row (0: the base model).
    #[pyo3(get)]
    adapters: Py<PyArray1<u32>>,
    #[pyo3(get)]
    block_table: Py<PyArray2<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    /// With a sliding-window pool: its block tables [B, W] (0 behind the
    /// window) and slot of each token [T]; None without one.
    #[pyo3(get)]
    window_block_table: Option<Py<PyArray2<i32>>>,
    #[pyo3(get)]
    window_slot_mapping: Option<Py<PyArray1<i64>>>,
    /// With recurrent state: each row's state slot [B] (a row with no
    /// computed tokens starts from a zero state); None without.
    #[pyo3(get)]
    state_slots: Option<Py<PyArray1<i32>>>,
    /// With state snapshots: [R, 2] (snapshot, state slot) to fill before
    /// the step, [W, 2] (state slot, snapshot) to write after it; None
    /// without.
    #[pyo3(get)]
    state_restores: Option<Py<PyArray2<i32>>>,
    #[pyo3(get)]
    state_saves: Option<Py<PyArray2<i32>>>,
    /// KV slots to copy before the step, pairwise (every source read before
    /// any destination is written), in the full-attention pool: a prefix
    /// hit's positions that a cached block shares; None when there are none.
    #[pyo3(get)]
    kv_copy_src: Option<Py<PyArray1<i64>>>,
    #[pyo3(get)]
    kv_copy_dst: Option<Py<PyArray1<i64>>>,
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sample_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    preempted_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    aborted_ids: Py<PyArray1<i64>>,
}

impl PyBatchPlan {
    /// `windowed`: the scheduler has a sliding-window pool; `stateful`:
    /// recurrent-state slots; `snapshots`: state snapshots.
    fn new(
        py: Python<'_>,
        mut plan: BatchPlan,
        windowed: bool,
        stateful: bool,
        snapshots: bool,
    ) -> PyResult<Self> {
        let (num_reqs, width) = (plan.num_reqs(), plan.block_table_width);
        let block_table = std::mem::take(&mut plan.block_table)
            .into_pyarray(py)
            .reshape([num_reqs, width])?;
        let (window_block_table, window_slot_mapping) = if windowed {
            let table = std::mem::take(&mut plan.window_block_table)
                .into_pyarray(py)
                .reshape([num_reqs, width])?;
            let slots = std::mem::take(&mut plan.window_slot_mapping).into_pyarray(py);
            (Some(table.unbind()), Some(slots.unbind()))
        } else {
            (None, None)
        };
        let state_slots = stateful.then(|| {
            std::mem::take(&mut plan.state_slots)
                .into_pyarray(py)
                .unbind()
        });
        let pairs = |v: Vec<i32>| -> PyResult<Py<PyArray2<i32>>> {
            let n = v.len() / 2;
            Ok(v.into_pyarray(py).reshape([n, 2])?.unbind())
        };
        let (state_restores, state_saves) = if snapshots {
            (
                Some(pairs(std::mem::take(&mut plan.state_restores))?),
                Some(pairs(std::mem::take(&mut plan.state_saves))?),
            )
        } else {
            (None, None)
        };
        let (kv_copy_src, kv_copy_dst) = if plan.kv_copy_src.is_empty() {
            (None, None)
        } else {
            (
                Some(
                    std::mem::take(&mut plan.kv_copy_src)
                        .into_pyarray(py)
                        .unbind(),
                ),
                Some(
                    std::mem::take(&mut plan.kv_copy_dst)
                        .into_pyarray(py)
                        .unbind(),
                ),
            )
        };
        Ok(Self {
            kv_copy_src,
            kv_copy_dst,
            window_block_table,
            window_slot_mapping,
            state_slots,
            state_restores,
            state_saves,
            step_id: plan.step_id,
            num_reqs,
            num_tokens: plan.num_tokens(),
            num_decodes: plan.num_decodes,
            num_drafts_total: plan.num_drafts_total,
            req_ids: as_i64(&plan.req_ids).into_pyarray(py).unbind(),
            num_scheduled_tokens: plan.num_scheduled_tokens.clone().into_pyarray(py).unbind(),
            num_computed_tokens: std::mem::take(&mut plan.num_computed_tokens)
                .into_pyarray(py)
                .unbind(),
            num_draft_tokens: plan.num_draft_tokens.clone().into_pyarray(py).unbind(),
            input_ids: std::mem::take(&mut plan.input_ids)
                .into_pyarray(py)
                .unbind(),
            positions: std::mem::take(&mut plan.positions)
                .into_pyarray(py)
                .unbind(),
            query_start_loc: std::mem::take(&mut plan.query_start_loc)
                .into_pyarray(py)
                .unbind(),
            seq_lens: std::mem::take(&mut plan.seq_lens).into_pyarray(py).unbind(),
            adapters: std::mem::take(&mut plan.adapters).into_pyarray(py).unbind(),
            block_table: block_table.unbind(),
            slot_mapping: std::mem::take(&mut plan.slot_mapping)
                .into_pyarray(py)
                .unbind(),
            logits_indices: std::mem::take(&mut plan.logits_indices)
                .into_pyarray(py)
                .unbind(),
            sample_rows: plan.sample_rows.clone().into_pyarray(py).unbind(),
            preempted_ids: as_i64(&plan.preempted_ids).into_pyarray(py).unbind(),
            aborted_ids: as_i64(&plan.aborted_ids).into_pyarray(py).unbind(),
            core: plan,
        })
    }
}

#[pymethods]
impl PyBatchPlan {
    fn __len__(&self) -> usize {
        self.num_reqs
    }
    #[getter]
    fn num_sampled(&self) -> usize {
        self.core.sample_rows.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "BatchPlan(step_id={}, num_reqs={}, num_tokens={}, num_decodes={}, num_sampled={})",
            self.step_id,
            self.num_reqs,
            self.num_tokens,
            self.num_decodes,
            self.core.sample_rows.len()
        )
    }
}

/// The scheduler's counters for metrics.
#[pyclass(name = "SchedulerStats", module = "ferrox._native", frozen, get_all)]
pub struct PySchedulerStats {
    num_running: usize,
    num_waiting: usize,
    num_total_blocks: usize,
    num_free_blocks: usize,
    num_used_blocks: usize,
    num_cached_blocks: usize,
    /// The sliding-window pool (0 without one): size, free, cache-only.
    num_window_blocks: usize,
    num_free_window_blocks: usize,
    num_cached_window_blocks: usize,
    /// Recurrent-state slots (0 without recurrent state) and those free.
    num_state_slots: usize,
    num_free_state_slots: usize,
    /// State snapshots (0 without) and those the prefix cache holds.
    num_state_snapshots: usize,
    num_cached_state_snapshots: usize,
    prefix_queried_tokens: u64,
    prefix_hit_tokens: u64,
    num_preemptions: u64,
    /// Verifications (one per request and step that speculated).
    spec_num_drafts: u64,
    spec_num_draft_tokens: u64,
    spec_num_accepted_tokens: u64,
    /// [a]: verifications that kept exactly a draft tokens.
    spec_accepted_lengths: Vec<u64>,
    /// [i]: draft tokens accepted at position i.
    spec_accepted_per_position: Vec<u64>,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        Self {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_total_blocks: s.num_total_blocks,
            num_free_blocks: s.num_free_blocks,
            num_used_blocks: s.num_used_blocks,
            num_cached_blocks: s.num_cached_blocks,
            num_window_blocks: s.num_window_blocks,
            num_free_window_blocks: s.num_free_window_blocks,
            num_cached_window_blocks: s.num_cached_window_blocks,
            num_state_slots: s.num_state_slots,
            num_free_state_slots: s.num_free_state_slots,
            num_state_snapshots: s.num_state_snapshots,
            num_cached_state_snapshots: s.num_cached_state_snapshots,
            prefix_queried_tokens: s.prefix_queried_tokens,
            prefix_hit_tokens: s.prefix_hit_tokens,
            num_preemptions: s.num_preemptions,
            spec_num_drafts: s.spec.num_drafts,
            spec_num_draft_tokens: s.spec.num_draft_tokens,
            spec_num_accepted_tokens: s.spec.num_accepted_tokens,
            spec_accepted_lengths: s.spec.accepted_lengths.to_vec(),
            spec_accepted_per_position: s.spec.accepted_per_position.to_vec(),
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(num_running={}, num_waiting={}, num_total_blocks={}, \
             num_free_blocks={}, num_used_blocks={}, num_cached_blocks={}, \
             prefix_queried_tokens={}, prefix_hit_tokens={}, num_preemptions={})",
            self.num_running,
            self.num_waiting,
            self.num_total_blocks,
            self.num_free_blocks,
            self.num_used_blocks,
            self.num_cached_blocks,
            self.prefix_queried_tokens,
            self.prefix_hit_tokens,
            self.num_preemptions
        )
    }
}

/// What one `update` reports: per request that sampled or finished, the new
/// token (-1 for none) and the finish reason (0 running, then `FINISH_STOP`,
/// `FINISH_LENGTH`, `FINISH_ABORT`); and the scheduler's counters after it.
#[pyclass(name = "StepEvents", module = "ferrox._native", frozen)]
pub struct PyStepEvents {
    #[pyo3(get)]
    req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    token_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    finish_reasons: Py<PyArray1<u8>>,
    /// Per request that verified drafts: its id, drafts verified, accepted.
    #[pyo3(get)]
    verified_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    num_drafted: Py<PyArray1<u32>>,
    #[pyo3(get)]
    num_accepted: Py<PyArray1<u32>>,
    #[pyo3(get)]
    stats: Py<PySchedulerStats>,
    len: usize,
}

impl PyStepEvents {
    fn new(py: Python<'_>, events: StepEvents, stats: SchedulerStats) -> PyResult<Self> {
        Ok(Self {
            len: events.len(),
            req_ids: as_i64(&events.req_ids).into_pyarray(py).unbind(),
            token_ids: events.token_ids.into_pyarray(py).unbind(),
            finish_reasons: events.finish_reasons.into_pyarray(py).unbind(),
            verified_ids: as_i64(&events.verified_ids).into_pyarray(py).unbind(),
            num_drafted: events.num_drafted.into_pyarray(py).unbind(),
            num_accepted: events.num_accepted.into_pyarray(py).unbind(),
            stats: Py::new(py, PySchedulerStats::from(stats))?,
        })
    }
}

#[pymethods]
impl PyStepEvents {
    fn __len__(&self) -> usize {
        self.len
    }
}

/// Continuous-batching scheduler over a paged KV pool with prefix caching.
#[pyclass(name = "Scheduler", module = "ferrox._native")]
pub struct PyScheduler {
    inner: Scheduler,
}

fn request_id(id: i64) -> PyResult<u64> {
    u64::try_from(id)
        .map_err(|_| invalid_argument(format!("request ids must be non-negative, got {id}")))
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        *, block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
        vocab_size, enable_prefix_caching = true, enable_chunked_prefill = true,
        policy = "fcfs", speculative_method = None, num_speculative_tokens = 0,
        prompt_lookup_min = 1, prompt_lookup_max = 4, spec_adaptive = true,
        spec_disable_by_batch_size = None, sliding_window = None, num_window_blocks = 0,
        max_adapters = 0, num_state_slots = 0, num_state_snapshots = 0,
        max_encoder_tokens_per_step = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    /// `speculative_method`: None (off), "ngram" (the scheduler proposes by
    /// prompt lookup) or "external" (the caller fills the draft positions
    /// and passes its drafts to `update`). `sliding_window`: the window of
    /// the model's sliding-window layers, whose KV lives in a second pool of
    /// `num_window_blocks` blocks (None: one pool for every layer).
    /// `max_adapters`: the most distinct LoRA adapters running at once (0:
    /// requests with one are refused). `num_state_slots`: recurrent-state
    /// slots, one per running request (a hybrid model's linear-attention
    /// layers; 0: none). `num_state_snapshots`: with recurrent state and
    /// prefix caching, the state snapshots the prefix cache keeps.
    /// `max_encoder_tokens_per_step`: the encoder rows (images) one step's
    /// chunks may start (0: unbounded; see `SchedulerConfig`).
    fn new(
        block_size: usize,
        num_blocks: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        vocab_size: usize,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool,
        policy: &str,
        speculative_method: Option<&str>,
        num_speculative_tokens: usize,
        prompt_lookup_min: usize,
        prompt_lookup_max: usize,
        spec_adaptive: bool,
        spec_disable_by_batch_size: Option<usize>,
        sliding_window: Option<usize>,
        num_window_blocks: usize,
        max_adapters: usize,
        num_state_slots: usize,
        num_state_snapshots: usize,
        max_encoder_tokens_per_step: usize,
    ) -> PyResult<Self> {
        let method = match speculative_method {
            None => None,
            Some("ngram") => Some(SpecMethod::Ngram {
                min: prompt_lookup_min,
                max: prompt_lookup_max,
            }),
            Some("external") => Some(SpecMethod::External),
            Some(other) => {
                return Err(invalid_argument(format!(
                    "speculative_method must be 'ngram' or 'external', got {other:?}"
                )))
            }
        };
        let speculation = method.map(|method| SpecConfig {
            method,
            num_tokens: num_speculative_tokens,
            adaptive: spec_adaptive,
            disable_by_batch_size: spec_disable_by_batch_size,
        });
        let config = SchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            vocab_size,
            enable_prefix_caching,
            enable_chunked_prefill,
            policy: policy.parse::<Policy>().or_raise()?,
            speculation,
            sliding_window,
            num_window_blocks,
            max_adapters,
            num_state_slots,
            num_state_snapshots,
            max_encoder_tokens_per_step,
        };
        Ok(Self {
            inner: Scheduler::new(config).or_raise()?,
        })
    }

    /// Queues a request; `max_tokens=None` means up to the context limit.
    #[pyo3(signature = (
        request_id, prompt_token_ids, *, max_tokens = None, min_tokens = 0,
        eos_token_ids = None, stop_token_ids = None, ignore_eos = false, priority = 0,
        use_prefix_cache = true, adapter = 0, atomic_spans = None, encoder_spans = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: i64,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: Option<usize>,
        min_tokens: usize,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        priority: i32,
        use_prefix_cache: bool,
        adapter: u32,
        atomic_spans: Option<Vec<(usize, usize)>>,
        encoder_spans: Option<Vec<(usize, usize)>>,
    ) -> PyResult<()> {
        let id = self::request_id(request_id)?;
        let prompt = extract_ids(prompt_token_ids, "prompt_token_ids")?;
        let ids = |obj: Option<&Bound<'_, PyAny>>, what| {
            obj.map_or(Ok(Vec::new()), |o| extract_ids(o, what))
        };
        let params = RequestParams {
            max_tokens: max_tokens.unwrap_or(usize::MAX),
            min_tokens,
            eos_token_ids: ids(eos_token_ids, "eos_token_ids")?,
            stop_token_ids: ids(stop_token_ids, "stop_token_ids")?,
            ignore_eos,
            priority,
            use_prefix_cache,
            adapter,
            atomic_spans: atomic_spans.unwrap_or_default(),
            encoder_spans: encoder_spans.unwrap_or_default(),
        };
        let inner = &mut self.inner;
        py.detach(|| inner.add_request(id, &prompt, params))
            .or_raise()
    }

    /// Ends a request in any state; False if the id is unknown.
    fn abort(&mut self, py: Python<'_>, request_id: i64) -> PyResult<bool> {
        let id = self::request_id(request_id)?;
        let inner = &mut self.inner;
        py.detach(|| inner.abort(id)).or_raise()
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyBatchPlan> {
        let inner = &mut self.inner;
        let plan = py.detach(|| inner.schedule()).or_raise()?;
        let config = self.inner.config();
        let windowed = config.sliding_window.is_some();
        let (stateful, snapshots) = (config.num_state_slots > 0, config.num_state_snapshots > 0);
        PyBatchPlan::new(py, plan, windowed, stateful, snapshots)
    }

    /// Applies a step: one sampled token per logits index; `draft_token_ids`,
    /// rows in order, when the caller proposed the plan's drafts.
    #[pyo3(signature = (plan, sampled_token_ids, finished_externally = None, draft_token_ids = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        plan: PyRef<'_, PyBatchPlan>,
        sampled_token_ids: &Bound<'_, PyAny>,
        finished_externally: Option<&Bound<'_, PyAny>>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepEvents> {
        let sampled = extract_ids(sampled_token_ids, "sampled_token_ids")?;
        let drafts = match draft_token_ids {
            Some(obj) => Some(extract_ids(obj, "draft_token_ids")?),
            None => None,
        };
        let finished = match finished_externally {
            Some(obj) => extract_u64s(obj, "finished_externally")?,
            None => Vec::new(),
        };
        let core = &plan.core;
        let inner = &mut self.inner;
        let (events, stats) = py
            .detach(|| -> ferrox_core::Result<_> {
                let events = inner.update(core, &sampled, &finished, drafts.as_deref())?;
                Ok((events, inner.stats()))
            })
            .or_raise()?;
        PyStepEvents::new(py, events, stats)
    }

    /// The measured step cost adaptive speculation weighs drafts by: seconds
    /// per step, per token in it, and per draft token proposed.
    fn set_spec_cost(
        &mut self,
        step_seconds: f64,
        token_seconds: f64,
        draft_seconds: f64,
    ) -> PyResult<()> {
        self.inner
            .set_spec_cost(SpecCost {
                step_seconds,
                token_seconds,
                draft_seconds,
            })
            .or_raise()
    }

    /// Drops every cached prefix no request uses; returns the blocks freed.
    fn reset_prefix_cache(&mut self, py: Python<'_>) -> PyResult<usize> {
        let inner = &mut self.inner;
        py.detach(|| inner.reset_prefix_cache()).or_raise()
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }
    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }

    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.inner.config().sliding_window
    }

    #[getter]
    fn num_window_blocks(&self) -> usize {
        self.inner.config().num_window_blocks
    }
    #[getter]
    fn num_state_slots(&self) -> usize {
        self.inner.config().num_state_slots
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.config().max_num_batched_tokens
    }

    /// Counters for metrics (every `update` also returns them).
    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
    }

    /// A live request's state as a dict, or None for an unknown id.
    fn request_info<'py>(
        &self,
        py: Python<'py>,
        request_id: i64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(req) = self.inner.request(self::request_id(request_id)?) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let status = match req.status {
            RequestStatus::Waiting => "waiting",
            RequestStatus::Running => "running",
        };
        d.set_item("status", status)?;
        d.set_item("num_prompt_tokens", req.num_prompt_tokens)?;
        d.set_item("num_tokens", req.num_tokens())?;
        d.set_item("num_computed_tokens", req.num_computed_tokens)?;
        d.set_item("num_prefix_hit_tokens", req.num_prefix_hit_tokens)?;
        d.set_item("num_preemptions", req.num_preemptions)?;
        d.set_item("num_blocks", req.block_table.len())?;
        let held = req
            .window_table
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count();
        d.set_item("num_window_blocks", held)?;
        d.set_item("spec_accept_rate", req.spec.accept_rate)?;
        d.set_item("spec_num_draft_tokens", req.spec.num_draft_tokens)?;
        d.set_item("spec_num_accepted_tokens", req.spec.num_accepted_tokens)?;
        Ok(Some(d))
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.check_integrity()).or_raise()
    }
}
