//! `CpuMoeExperts`: an MoE block's router and block-format experts, held
//! once, and the block's forward on a few tokens (`ferrox_cpu::route`, then
//! `ferrox_cpu::moe_experts`).

use ferrox_cpu::{
    moe_experts, route, BlockLayout, ExpertWeights, Gate, MoeArgs, QuantFormat, Router,
};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid_argument;
use crate::kernels::{block_layout, contiguous, contiguous_mut, quant_format};

#[pyclass(module = "ferrox._native", frozen)]
pub struct CpuMoeExperts {
    router: Py<PyArray2<f32>>, // [experts, hidden]
    top_k: usize,
    renormalize: bool,
    gate_up: Vec<Py<PyArray2<u8>>>, // per expert: [2 I, row bytes of hidden]
    down: Vec<Py<PyArray2<u8>>>,    // per expert: [hidden, row bytes of I]
    gate_up_fmt: QuantFormat,
    down_fmt: QuantFormat,
    layout: BlockLayout,
    hidden: usize,
    inter: usize,
    /// gpt-oss: the router's bias [experts], each expert's gate/up [2 I]
    /// and down [hidden] biases (flattened, expert by expert).
    router_bias: Option<Vec<f32>>,
    expert_biases: Option<(Vec<f32>, Vec<f32>)>,
    activation: Gate,
}

#[pymethods]
impl CpuMoeExperts {
    /// `router`: float32 [experts, hidden], picking `top_k` experts a
    /// token (their weights rescaled to sum to one with `renormalize`);
    /// `gate_up[e]` and `down[e]`: expert e's block-format weights (uint8),
    /// in `gate_up_fmt` and `down_fmt` ("q8_0" / "q4_1" / "q6_k" / "q4_k"), all in the
    /// kernels' panels with `packed`. gpt-oss:
    /// `router_bias` [experts], `expert_biases` (gate/up [E, 2 I], down [E,
    /// hidden]), `clamped_swiglu` (alpha, limit) for the experts' gate.
    #[new]
    #[pyo3(signature = (router, top_k, renormalize, gate_up, down, gate_up_fmt, down_fmt, hidden, inter, router_bias=None, expert_biases=None, clamped_swiglu=None, packed=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        router: Bound<'_, PyArray2<f32>>,
        top_k: usize,
        renormalize: bool,
        gate_up: Vec<Bound<'_, PyArray2<u8>>>,
        down: Vec<Bound<'_, PyArray2<u8>>>,
        gate_up_fmt: &str,
        down_fmt: &str,
        hidden: usize,
        inter: usize,
        router_bias: Option<Vec<f32>>,
        expert_biases: Option<(Vec<f32>, Vec<f32>)>,
        clamped_swiglu: Option<(f32, f32)>,
        packed: bool,
    ) -> PyResult<Self> {
        let experts = gate_up.len();
        if router_bias.as_ref().is_some_and(|b| b.len() != experts)
            || expert_biases.as_ref().is_some_and(|(gu, d)| {
                gu.len() != experts * 2 * inter || d.len() != experts * hidden
            })
        {
            return Err(invalid_argument(format!(
                "the router bias must be [{experts}], the experts' [{experts}, {}] and [{experts}, \
                 {hidden}]",
                2 * inter
            )));
        }
        let activation = match clamped_swiglu {
            None => Gate::Silu,
            Some((alpha, limit)) => Gate::ClampedSwiGlu { alpha, limit },
        };
        let (gate_up_fmt, down_fmt) = (quant_format(gate_up_fmt)?, quant_format(down_fmt)?);
        if gate_up.is_empty() || gate_up.len() != down.len() {
            return Err(invalid_argument(format!(
                "{} gate/up and {} down weights: one of each per expert",
                gate_up.len(),
                down.len()
            )));
        }
        if router.shape() != [gate_up.len(), hidden] || top_k == 0 || top_k > gate_up.len() {
            return Err(invalid_argument(format!(
                "the router must be [{}, {hidden}] float32 and pick 1 to {} experts, got {:?} and {top_k}",
                gate_up.len(),
                gate_up.len(),
                router.shape()
            )));
        }
        let expected = |fmt: QuantFormat, rows: usize, k: usize| [rows, fmt.row_bytes(k)];
        let shapes_ok = gate_up
            .iter()
            .all(|w| w.shape() == expected(gate_up_fmt, 2 * inter, hidden))
            && down
                .iter()
                .all(|w| w.shape() == expected(down_fmt, hidden, inter));
        if !shapes_ok || !hidden.is_multiple_of(32) || !inter.is_multiple_of(32) {
            return Err(invalid_argument(format!(
                "expert weights must be [{}, {}] and [{}, {}] bytes",
                2 * inter,
                gate_up_fmt.row_bytes(hidden),
                hidden,
                down_fmt.row_bytes(inter)
            )));
        }
        Ok(Self {
            router: router.unbind(),
            top_k,
            renormalize,
            gate_up: gate_up.into_iter().map(Bound::unbind).collect(),
            down: down.into_iter().map(Bound::unbind).collect(),
            gate_up_fmt,
            down_fmt,
            layout: block_layout(packed),
            hidden,
            inter,
            router_bias,
            expert_biases,
            activation,
        })
    }

    /// `out` ([T, hidden]) = the block on `x` ([T, hidden]): each token's
    /// chosen experts, weighted by the router. Only the chosen experts'
    /// weights are read.
    #[pyo3(signature = (out, x, num_threads))]
    fn forward(
        &self,
        py: Python<'_>,
        mut out: PyReadwriteArray2<'_, f32>,
        x: PyReadonlyArray2<'_, f32>,
        num_threads: usize,
    ) -> PyResult<()> {
        let x = contiguous(&x)?;
        let router_array = self.router.bind(py).readonly();
        let router = Router {
            weight: contiguous(&router_array)?,
            bias: self.router_bias.as_deref(),
            top_k: self.top_k,
            renormalize: self.renormalize,
        };
        let (ids, weights) = py
            .detach(|| route(x, self.hidden, &router, num_threads))
            .map_err(|e| invalid_argument(e.to_string()))?;
        let num_experts = self.gate_up.len();
        let mut used = vec![false; num_experts];
        for &id in &ids {
            match usize::try_from(id).ok().filter(|&e| e < num_experts) {
                Some(e) => used[e] = true,
                None => {
                    return Err(invalid_argument(format!(
                        "expert {id} out of {num_experts} experts"
                    )))
                }
            }
        }
        // Read views of the chosen experts only; the others stay empty.
        let views: Vec<Option<(PyReadonlyArray2<'_, u8>, PyReadonlyArray2<'_, u8>)>> = used
            .iter()
            .enumerate()
            .map(|(e, &u)| {
                u.then(|| {
                    (
                        self.gate_up[e].bind(py).readonly(),
                        self.down[e].bind(py).readonly(),
                    )
                })
            })
            .collect();
        let (inter, hidden) = (self.inter, self.hidden);
        let biases = |e: usize| {
            self.expert_biases.as_ref().map(|(gu, d)| {
                (
                    &gu[e * 2 * inter..(e + 1) * 2 * inter],
                    &d[e * hidden..(e + 1) * hidden],
                )
            })
        };
        let experts = views
            .iter()
            .enumerate()
            .map(|(e, v)| match v {
                Some((gu, d)) => Ok(ExpertWeights {
                    gate_up: contiguous(gu)?,
                    down: contiguous(d)?,
                    gate_up_bias: biases(e).map(|b| b.0),
                    down_bias: biases(e).map(|b| b.1),
                }),
                None => Ok(ExpertWeights {
                    gate_up: &[],
                    down: &[],
                    gate_up_bias: None,
                    down_bias: None,
                }),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let args = MoeArgs {
            x,
            expert_ids: &ids,
            expert_weights: &weights,
            experts: &experts,
            gate_up_fmt: self.gate_up_fmt,
            down_fmt: self.down_fmt,
            layout: self.layout,
            hidden: self.hidden,
            inter: self.inter,
            activation: self.activation,
            num_threads,
        };
        let out = contiguous_mut(&mut out, "out")?;
        py.detach(|| moe_experts(&args, out))
            .map_err(|e| invalid_argument(e.to_string()))
    }
}
