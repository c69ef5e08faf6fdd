//! Matmuls over block-quantized weights, kept in llama.cpp's block layouts:
//! every output row of a weight `[N, K]` is K/32 blocks of 32 weights.
//!
//! - `Q4_1` (20 bytes): scale `d` and offset `m` (float16), then 16 bytes of
//!   nibbles: byte j holds weight j (low nibble) and weight j + 16 (high);
//!   weight = d * q + m. GGUF's Q4_0 (weight = d * (q - 8)) is the same with
//!   m = -8 d, so both load into this one layout.
//! - `Q8_0` (34 bytes): scale `d` (float16), then 32 signed bytes;
//!   weight = d * q.
//! - `Q6_K` (210 bytes, a super-block of 256 weights): 128 bytes of low
//!   nibbles `ql`, 64 bytes of high bit pairs `qh`, sixteen signed scales
//!   (one per 16 weights), then `d` (float16); weight = d * scale * (q - 32)
//!   with the 6-bit q. llama.cpp's K-quant files keep their LM heads and
//!   some value and down projections in it: 6.56 bits a weight, where Q8_0
//!   would take 8.5.
//! - `Q4_K` (144 bytes, a super-block of 256): `d` and `dmin` (float16),
//!   twelve bytes of 6-bit scales and mins (one of each per 32 weights,
//!   `q4_k_scale_min`), then 128 bytes of nibbles (per 64 weights, 32 bytes:
//!   the low nibbles the first 32, the high ones the next);
//!   weight = d * scale * q - dmin * min. The 4-bit type of llama.cpp's
//!   K-quant files (Q4_K_M): 4.5 bits a weight, where Q4_1 takes 5.
//!
//! The activations are quantized on the fly to signed bytes, one scale per
//! block of 32 (as llama.cpp does), so each block's dot product is an
//! integer one: 32 multiply-adds in a few AVX2 instructions. A decode step
//! reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight instead of float32's 4.

use std::fmt;

use crate::activation::{gate_rows_threaded, Gate};
use crate::pool::{run_parts, run_parts_on};
use crate::quant_pack::{column_block, BlockLayout, PANEL};

pub const BLOCK: usize = 32;

/// Parts a matmul's columns are cut into per thread (see `quant_matmul`).
const PARTS_PER_THREAD: usize = 4;

/// Activation rows a thread takes its columns over at once (`RowChunks`;
/// 64 and 128 measured alike, 512 and all rows slower).
pub(crate) const ROW_CHUNK: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    Q4_1,
    Q8_0,
    Q6_K,
    Q4_K,
}

/// Weights in a K-quant super-block.
pub const SUPER_BLOCK: usize = 256;

impl QuantFormat {
    /// Bytes of one block (`block_values` weights).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q6_K => Q6_K_BYTES,
            QuantFormat::Q4_K => Q4_K_BYTES,
        }
    }

    /// Weights of one block: 32, or a K-quant's super-block of 256.
    pub fn block_values(self) -> usize {
        match self {
            QuantFormat::Q4_1 | QuantFormat::Q8_0 => BLOCK,
            QuantFormat::Q6_K | QuantFormat::Q4_K => SUPER_BLOCK,
        }
    }

    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantShapeError(pub String);

impl fmt::Display for QuantShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for QuantShapeError {}

/// float16 bits to float32 (every class: zero, subnormal, normal, inf, NaN).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits >> 15) as u32) << 31;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let frac = (bits & 0x3ff) as u32;
    let magnitude = match exp {
        0 => {
            let value = frac as f32 * 2f32.powi(-24); // subnormal (or zero)
            return if sign == 0 { value } else { -value };
        }
        0x1f => 0x7f80_0000 | (frac << 13),
        _ => ((exp + 112) << 23) | (frac << 13),
    };
    f32::from_bits(sign | magnitude)
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Activations quantized per block of 32: `q` signed bytes, `d` the scale,
/// `s` = d * sum(q) (what a Q4_1 offset and a Q4_K min multiply).
pub struct QuantizedActivations {
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    /// -32 times the integer sum of each 16 `q` (Q6_K's offset of 32 times
    /// the activations under each of its scales), or empty: `for_format`
    /// fills them.
    pub h: Vec<i32>,
}

impl QuantizedActivations {
    /// These activations with `h` filled where `fmt` reads it (Q6_K).
    pub fn for_format(mut self, fmt: QuantFormat) -> Self {
        if fmt == QuantFormat::Q6_K && self.h.is_empty() {
            self.h = self
                .q
                .chunks_exact(BLOCK / 2)
                .map(|half| -32 * half.iter().map(|&v| i32::from(v)).sum::<i32>())
                .collect();
        }
        self
    }
}

pub fn quantize_activations(x: &[f32], k: usize) -> QuantizedActivations {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::quant_matmul_vnni::quantize_supported() {
            // SAFETY: the CPU has the features.
            return unsafe { crate::quant_matmul_vnni::quantize_activations(x, k) };
        }
        if crate::isa::avx2() {
            // SAFETY: the CPU has AVX2.
            return unsafe { crate::quant_matmul_avx2::quantize_activations(x, k) };
        }
    }
    quantize_activations_impl(x, k)
}

/// `quantize_activations` in plain code, which the AVX2 and AVX-512
/// versions match bit for bit.
pub(crate) fn quantize_activations_impl(x: &[f32], k: usize) -> QuantizedActivations {
    let blocks = x.len() / BLOCK;
    debug_assert_eq!(x.len() % k, 0);
    let mut out = QuantizedActivations {
        q: vec![0; x.len()],
        d: vec![0.0; blocks],
        s: vec![0.0; blocks],
        h: Vec::new(),
    };
    for b in 0..blocks {
        let xs = &x[b * BLOCK..(b + 1) * BLOCK];
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in out.q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(xs) {
            let r = round_small(v * inv);
            *q = r as i8;
            sum += r;
        }
        out.d[b] = d;
        out.s[b] = d * sum as f32;
    }
    out
}

/// `x.round_ties_even() as i32` for |x| < 2^22, without a call to the C
/// library's `rintf` per value (what `round_ties_even` becomes without
/// SSE4.1): adding 1.5 * 2^23 leaves no fraction bits, so the addition
/// itself rounds, to nearest even; the compiler vectorises it.
#[inline(always)]
fn round_small(x: f32) -> i32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23
    ((x + SHIFT) - SHIFT) as i32
}

/// A Q6_K super-block's 6-bit value `i` (0..256), before its offset of 32.
#[inline(always)]
pub(crate) fn q6_k_value(block: &[u8], i: usize) -> u8 {
    // halves of 128: value l + 32 j of a half takes ql byte l + 32 (j & 1)
    // of the half's 64 (the high nibble for j >= 2) and qh byte l's bits 2j
    let (half, j, l) = (i / 128, i % 128 / 32, i % 32);
    let low = block[64 * half + l + 32 * (j & 1)] >> (4 * (j >> 1)) & 0x0f;
    let high = block[128 + 32 * half + l] >> (2 * j) & 3;
    low | high << 4
}

/// A Q4_K super-block's 4-bit value `i` (0..256): per 64 values, 32
/// bytes, the first 32 values in their low nibbles, the next in the high.
#[inline(always)]
pub(crate) fn q4_k_value(block: &[u8], i: usize) -> u8 {
    let byte = block[Q4_K_QUANTS + 32 * (i / 64) + i % 32];
    byte >> (4 * (i % 64 / 32)) & 0x0f
}

/// A Q4_K super-block's 6-bit scale and min of 32-value block `j` (0..8):
/// blocks 0..4 in the low six bits of scale bytes j and j + 4, blocks 4..8
/// in the nibbles of byte j + 4 with the top bits of bytes j - 4 and j.
#[inline(always)]
pub(crate) fn q4_k_scale_min(block: &[u8], j: usize) -> (u8, u8) {
    let s = &block[Q4_K_SCALES..Q4_K_QUANTS];
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4,
            (s[j + 4] >> 4) | (s[j] >> 6) << 4,
        )
    }
}

/// A Q4_K block's bytes, and where its scales and its nibbles start (`d`
/// and `dmin` first).
const Q4_K_BYTES: usize = 144;
const Q4_K_SCALES: usize = 4;
const Q4_K_QUANTS: usize = 16;

/// A Q6_K block's bytes, and where its sixteen scales and `d` start.
const Q6_K_BYTES: usize = 210;
pub(crate) const Q6_K_SCALES: usize = 192;
pub(crate) const Q6_K_D: usize = 208;

/// One weight row's block `b` as `fmt.block_values()` floats.
fn dequantize_block(row: &[u8], fmt: QuantFormat, b: usize, out: &mut [f32]) {
    let at = b * fmt.block_bytes();
    match fmt {
        QuantFormat::Q6_K => {
            let block = &row[at..at + fmt.block_bytes()];
            let d = half(block, Q6_K_D);
            for (i, v) in out[..SUPER_BLOCK].iter_mut().enumerate() {
                let scale = block[Q6_K_SCALES + i / 16] as i8;
                *v = d * f32::from(scale) * (i32::from(q6_k_value(block, i)) - 32) as f32;
            }
        }
        QuantFormat::Q4_K => {
            let block = &row[at..at + fmt.block_bytes()];
            let (d, dmin) = (half(block, 0), half(block, 2));
            for (i, v) in out[..SUPER_BLOCK].iter_mut().enumerate() {
                let (scale, min) = q4_k_scale_min(block, i / BLOCK);
                *v = d * f32::from(scale) * f32::from(q4_k_value(block, i)) - dmin * f32::from(min);
            }
        }
        QuantFormat::Q4_1 => {
            let (d, m) = (half(row, at), half(row, at + 2));
            for j in 0..16 {
                let byte = row[at + 4 + j];
                out[j] = d * (byte & 0x0f) as f32 + m;
                out[j + 16] = d * (byte >> 4) as f32 + m;
            }
        }
        QuantFormat::Q8_0 => {
            let d = half(row, at);
            for j in 0..BLOCK {
                out[j] = d * (row[at + 2 + j] as i8) as f32;
            }
        }
    }
}

/// Rows `rows` of a quantized `[N, K]` weight in `layout` as float32
/// `[rows.len(), K]` (an embedding lookup, or the whole matrix for a large
/// matmul).
pub fn dequantize_rows(
    w: &[u8],
    fmt: QuantFormat,
    layout: BlockLayout,
    k: usize,
    rows: &[usize],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), QuantShapeError> {
    let row_bytes = check_k(fmt, k)?;
    let n = w.len() / row_bytes;
    if !w.len().is_multiple_of(row_bytes) || out.len() != rows.len() * k {
        return Err(QuantShapeError(
            "weight or output size does not match K".into(),
        ));
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        return Err(QuantShapeError(format!("row {bad} out of range (N={n})")));
    }
    let vector = crate::isa::avx2();
    let one_row = |r: usize, dst: &mut [f32]| {
        let mut gathered = Vec::new();
        let row = if layout == BlockLayout::Panels && r < n / PANEL * PANEL {
            gathered.resize(row_bytes, 0);
            for (b, block) in gathered.chunks_exact_mut(fmt.block_bytes()).enumerate() {
                column_block(w, layout, fmt, k, r, b, block);
            }
            &gathered[..]
        } else {
            &w[r * row_bytes..(r + 1) * row_bytes]
        };
        #[cfg(target_arch = "x86_64")]
        if vector && fmt.block_values() == BLOCK {
            // SAFETY: the features were detected; `row` holds K / 32 blocks.
            unsafe { crate::quant_matmul_avx2::dequantize_row(row, fmt, dst) };
            return;
        }
        let _ = vector;
        let values = fmt.block_values();
        for b in 0..k / values {
            dequantize_block(row, fmt, b, &mut dst[b * values..(b + 1) * values]);
        }
    };
    let threads = num_threads.min((rows.len() * k).div_ceil(1 << 16)).max(1);
    let per = rows.len().div_ceil(threads);
    let ptr = OutPtr(out.as_mut_ptr());
    run_parts(threads, &|part| {
        let (start, end) = (part * per, ((part + 1) * per).min(rows.len()));
        for (i, &r) in rows.iter().enumerate().take(end).skip(start) {
            // SAFETY: each part writes only its own rows of `out`.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(i * k), k) };
            one_row(r, dst);
        }
    });
    Ok(())
}

pub(crate) fn check_k(fmt: QuantFormat, k: usize) -> Result<usize, QuantShapeError> {
    let values = fmt.block_values();
    if k == 0 || !k.is_multiple_of(values) {
        return Err(QuantShapeError(format!(
            "K={k} is not a positive multiple of {values} ({fmt:?})"
        )));
    }
    Ok(fmt.row_bytes(k))
}

#[derive(Clone, Copy)]
pub struct QuantMatmulArgs<'a> {
    pub x: &'a [f32],            // [M, K]
    pub w: &'a [u8],             // [N, row_bytes], in `layout`
    pub bias: Option<&'a [f32]>, // [N]
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub fmt: QuantFormat,
    pub layout: BlockLayout,
    pub num_threads: usize,
}

/// A raw pointer to the output, shared by threads that write disjoint
/// columns of it.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The kernels of the block matmul. `Pairs` runs everywhere (portable code
/// where the CPU lacks AVX2, FMA and F16C); the panel kernels need AVX2
/// (`Panels`, a panel as two halves of eight columns; `VnniPanels`, the
/// same loops with AVX-VNNI's dot products and the same bits) or AVX-512
/// VNNI (`WidePanels`, all sixteen at once) and take whole packed panels
/// (`quant_pack`), the columns past the last one going to `Pairs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKernel {
    Pairs,
    Panels,
    VnniPanels,
    WidePanels,
}

impl QuantKernel {
    pub const ALL: [QuantKernel; 4] = [
        Self::Pairs,
        Self::Panels,
        Self::VnniPanels,
        Self::WidePanels,
    ];

    /// Whether this CPU runs the kernel.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Self::Pairs => true,
                Self::Panels => crate::isa::avx2(),
                Self::VnniPanels => crate::isa::avx_vnni(),
                Self::WidePanels => crate::isa::avx2() && crate::quant_matmul_vnni::supported(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        matches!(self, Self::Pairs)
    }

    /// The kernel every call runs: the widest this CPU has, the same for
    /// every row count and format, so that a row's result never
    /// depends on how many rows share its call (the kernels round
    /// differently). By `rust/ferrox-cpu/benches/quant_matmul.rs`, the
    /// panels beat the pair kernel from one row even when they pack a
    /// rows-layout weight per call: AVX2 panels against the pair kernel,
    /// 1.11-1.34x at one row and 1.26-1.86x at two or three, on every shape
    /// of the bundled model.
    pub fn best() -> Self {
        if Self::WidePanels.supported() {
            Self::WidePanels
        } else if Self::VnniPanels.supported() {
            Self::VnniPanels
        } else if Self::Panels.supported() {
            Self::Panels
        } else {
            Self::Pairs
        }
    }

    /// The layout this kernel reads without rearranging the weight per
    /// call: what a loader should pack a weight into (`quant_pack`).
    pub fn layout(self) -> BlockLayout {
        match self {
            Self::Pairs => BlockLayout::Rows,
            Self::Panels | Self::VnniPanels | Self::WidePanels => BlockLayout::Panels,
        }
    }

    /// (the kernel for rows-layout columns, the panel kernel)
    fn functions(self) -> (Kernel, Option<PanelKernel>) {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::avx2() {
            let pairs: Kernel = crate::quant_matmul_avx2::columns;
            let panels: Option<PanelKernel> = match self {
                Self::Pairs => None,
                Self::Panels => Some(crate::quant_matmul_panel::panel),
                Self::VnniPanels => Some(crate::quant_matmul_panel::panel_vnni),
                Self::WidePanels => Some(crate::quant_matmul_vnni::panel),
            };
            return (pairs, panels);
        }
        (columns_portable, None)
    }
}

/// out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias): on a CPU with AMX
/// tiles, a call of `quant_matmul_amx::min_rows` rows or more takes them
/// (bfloat16 products: a row's result then depends on its call's row
/// count); every other call, as `quant_matmul_invariant`.
pub fn quant_matmul(args: &QuantMatmulArgs<'_>, out: &mut [f32]) -> Result<(), QuantShapeError> {
    #[cfg(target_arch = "x86_64")]
    if crate::quant_matmul_amx::takes(args) {
        check_shapes(args, out)?;
        // SAFETY: the CPU has the tiles and the format is theirs (`takes`);
        // the shapes are checked.
        unsafe { crate::quant_matmul_amx::matmul(args, None, out) };
        return Ok(());
    }
    quant_matmul_invariant(args, out)
}

/// A gated MLP's first half: out[M, I] = act(gate) * up, where [gate | up]
/// = x[M, K] @ dequant(w)[2 I, K]^T (+ bias), the gate's I columns first.
/// A call `quant_matmul` takes to the AMX tiles (and I a multiple of 16)
/// activates each tile's sums as they come out, so the [M, 2 I] sums are
/// never written; any other (and every `invariant` one) runs that
/// matmul's kernel into `gate_up` (resized as needed), then
/// `gate_rows_threaded`. Either way a value is the same bits as that
/// matmul then `gate_row` give.
pub fn quant_matmul_gated(
    args: &QuantMatmulArgs<'_>,
    gate: Gate,
    invariant: bool,
    gate_up: &mut Vec<f32>,
    out: &mut [f32],
) -> Result<(), QuantShapeError> {
    let (m, n) = (args.m, args.n);
    if !n.is_multiple_of(2) || out.len() != m * n / 2 {
        return Err(QuantShapeError(format!(
            "gated: N={n} must be even (gate, then up) and out hold M * N / 2 = {} floats, not {}",
            m * n / 2,
            out.len()
        )));
    }
    #[cfg(target_arch = "x86_64")]
    if !invariant && crate::quant_matmul_amx::takes(args) && (n / 2).is_multiple_of(PANEL) {
        check_inputs(args)?;
        // SAFETY: the CPU has the tiles and the format is theirs (`takes`);
        // the inputs are checked, `out` holds M * N / 2 floats and N / 2 is
        // whole panels.
        unsafe { crate::quant_matmul_amx::matmul(args, Some(gate), out) };
        return Ok(());
    }
    if gate_up.len() < m * n {
        gate_up.resize(m * n, 0.0);
    }
    let sums = &mut gate_up[..m * n];
    if invariant {
        quant_matmul_invariant(args, sums)?;
    } else {
        quant_matmul(args, sums)?;
    }
    gate_rows_threaded(gate, sums, n / 2, args.num_threads, out);
    Ok(())
}

/// out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias) on the same kernel for
/// every row count (`QuantKernel::best`): a row's result is the same bits
/// whatever the other rows of its call.
pub fn quant_matmul_invariant(
    args: &QuantMatmulArgs<'_>,
    out: &mut [f32],
) -> Result<(), QuantShapeError> {
    quant_matmul_with(args, out, QuantKernel::best())
}

/// `quant_matmul_invariant` with the given kernel (for tests and benchmarks
/// that set the kernels side by side); one this CPU lacks is an error.
pub fn quant_matmul_with(
    args: &QuantMatmulArgs<'_>,
    out: &mut [f32],
    kernel: QuantKernel,
) -> Result<(), QuantShapeError> {
    check_shapes(args, out)?;
    if !kernel.supported() {
        return Err(QuantShapeError(format!(
            "this CPU lacks the {kernel:?} kernel"
        )));
    }
    if args.m == 0 || args.n == 0 {
        return Ok(());
    }
    let chunks = RowChunks::new(args);
    // Column ranges of about equal size, in whole panels (or row pairs):
    // PARTS_PER_THREAD a thread, claimed as threads come free, so that a
    // worker woken late (after torch ops between two calls, it sleeps)
    // leaves the caller parts to take instead of a share to wait for; at
    // most `num_threads` threads take them (one: all on the caller).
    let unit = kernel.column_unit();
    let parts = (args.num_threads.max(1) * PARTS_PER_THREAD).clamp(1, args.n.div_ceil(unit));
    let per = args.n.div_ceil(unit).div_ceil(parts) * unit;
    let parts = args.n.div_ceil(per);
    let ptr = OutPtr(out.as_mut_ptr());
    run_parts_on(args.num_threads, parts, &|part| {
        let start = part * per;
        let end = ((part + 1) * per).min(args.n);
        // SAFETY: each part writes only columns start..end of `out`,
        // which has M * N elements (checked above); the CPU has the
        // kernel (checked above).
        unsafe { chunks.run_columns(kernel, start, end, ptr) };
    });
    Ok(())
}

/// The activations, weight, bias and output agree with M, K and N.
fn check_shapes(args: &QuantMatmulArgs<'_>, out: &[f32]) -> Result<(), QuantShapeError> {
    check_inputs(args)?;
    if out.len() != args.m * args.n {
        return Err(QuantShapeError(format!(
            "shapes disagree: out {} floats for M={} N={}",
            out.len(),
            args.m,
            args.n
        )));
    }
    Ok(())
}

/// x, w and the bias against M, K and N.
fn check_inputs(args: &QuantMatmulArgs<'_>) -> Result<(), QuantShapeError> {
    let row_bytes = check_k(args.fmt, args.k)?;
    if args.x.len() != args.m * args.k
        || args.w.len() != args.n * row_bytes
        || args.bias.is_some_and(|b| b.len() != args.n)
    {
        return Err(QuantShapeError(format!(
            "shapes disagree: x {} (M={} K={}), w {} bytes (N={}, {} per row)",
            args.x.len(),
            args.m,
            args.k,
            args.w.len(),
            args.n,
            row_bytes,
        )));
    }
    Ok(())
}

/// A matmul's activation rows in chunks of `ROW_CHUNK`, each quantized on
/// its own (a row's quantized values and products do not depend on the
/// other rows). A thread takes its columns over one chunk after another:
/// its share of the weight and one chunk's activations stay in the core's
/// cache, where one pass over all M rows would read every row's
/// activations again for each panel (a prefill chunk's thousands of rows
/// are megabytes: 1.15-1.2x on SmolLM2's gate/up at 1,024 rows and more,
/// `benches/quant_matmul.rs`).
pub(crate) struct RowChunks<'a> {
    chunks: Vec<(QuantMatmulArgs<'a>, QuantizedActivations)>,
}

impl<'a> RowChunks<'a> {
    pub(crate) fn new(args: &QuantMatmulArgs<'a>) -> Self {
        let chunks = (0..args.m)
            .step_by(ROW_CHUNK)
            .map(|first| {
                let rows = ROW_CHUNK.min(args.m - first);
                let x = &args.x[first * args.k..(first + rows) * args.k];
                let acts = quantize_activations(x, args.k).for_format(args.fmt);
                (
                    QuantMatmulArgs {
                        x,
                        m: rows,
                        ..*args
                    },
                    acts,
                )
            })
            .collect();
        Self { chunks }
    }

    /// Columns `start..end` of every row of `out` ([M, N]), chunk by chunk.
    ///
    /// # Safety
    /// As `run_columns`, for the whole call's M rows.
    pub(crate) unsafe fn run_columns(
        &self,
        kernel: QuantKernel,
        start: usize,
        end: usize,
        out: OutPtr,
    ) {
        for (i, (chunk, acts)) in self.chunks.iter().enumerate() {
            let rows = OutPtr(out.get().add(i * ROW_CHUNK * chunk.n));
            run_columns(kernel, chunk, acts, start, end, rows);
        }
    }
}

impl QuantKernel {
    /// The column count a thread's share of the output is a multiple of
    /// (a panel, or a pair of rows).
    pub(crate) fn column_unit(self) -> usize {
        self.functions().1.map_or(2, |_| PANEL)
    }
}

/// Columns `start..end` of `out` = x @ W^T for the activations `acts` of
/// `args.m` rows: whole panels through the panel kernel (a rows-layout
/// weight packed a panel at a time first), the columns past the last one
/// through the pair kernel. Without a panel kernel, the pair kernel reads a
/// rows-layout weight, and the portable loop any other.
///
/// # Safety
/// `out` points to M * N floats, and no other thread writes these columns;
/// `start` is a multiple of `kernel.column_unit()`; the CPU has `kernel`
/// (`QuantKernel::supported`); `args.w` holds N columns of `args.fmt`
/// blocks for K inputs in `args.layout`.
pub(crate) unsafe fn run_columns(
    kernel: QuantKernel,
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: OutPtr,
) {
    if start >= end {
        return;
    }
    let (pairs, panel) = kernel.functions();
    // columns from `whole` on are in the rows layout whatever `layout` says
    let whole = (args.n / PANEL * PANEL).clamp(start, end);
    match panel {
        Some(panel) => {
            debug_assert_eq!(start % PANEL, 0);
            let row_bytes = args.fmt.row_bytes(args.k);
            let mut packed = Vec::new();
            for col in (start..whole).step_by(PANEL) {
                let at = match args.layout {
                    BlockLayout::Panels => unsafe { args.w.as_ptr().add(col * row_bytes) },
                    BlockLayout::Rows => {
                        packed.resize(PANEL * row_bytes, 0);
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            crate::quant_matmul_panel::pack_panel(args, col, &mut packed)
                        };
                        packed.as_ptr()
                    }
                };
                unsafe { panel(args, acts, at, col, out.get()) };
            }
        }
        None if args.layout == BlockLayout::Panels && whole > start => unsafe {
            columns_portable(args, acts, start, whole, out.get())
        },
        None => return unsafe { pairs(args, acts, start, end, out.get()) },
    }
    if whole < end {
        unsafe { pairs(args, acts, whole, end, out.get()) };
    }
}

type Kernel = unsafe fn(&QuantMatmulArgs<'_>, &QuantizedActivations, usize, usize, *mut f32);

/// Every row of one panel's sixteen columns from the panel's packed bytes.
type PanelKernel =
    unsafe fn(&QuantMatmulArgs<'_>, &QuantizedActivations, *const u8, usize, *mut f32);

/// Columns `start..end` of the output, one block dot product at a time,
/// from a weight in either layout.
///
/// # Safety
/// `out` points to M * N floats; no other thread writes these columns.
pub unsafe fn columns_portable(
    args: &QuantMatmulArgs<'_>,
    acts: &QuantizedActivations,
    start: usize,
    end: usize,
    out: *mut f32,
) {
    let blocks = args.k / BLOCK;
    let mut row = vec![0u8; args.fmt.row_bytes(args.k)];
    for col in start..end {
        for (b, block) in row.chunks_exact_mut(args.fmt.block_bytes()).enumerate() {
            column_block(args.w, args.layout, args.fmt, args.k, col, b, block);
        }
        let row = &row;
        for i in 0..args.m {
            let mut acc = 0f32;
            for b in 0..blocks {
                // (block b's bytes in a 32-value format; `q6_k_block` and
                // `q4_k_block` find theirs in the super-block)
                let at = b * args.fmt.block_bytes();
                let xb = i * blocks + b;
                let xq = &acts.q[xb * BLOCK..(xb + 1) * BLOCK];
                match args.fmt {
                    QuantFormat::Q4_1 => {
                        let mut dot = 0i32;
                        for j in 0..16 {
                            let byte = row[at + 4 + j];
                            dot += (byte & 0x0f) as i32 * xq[j] as i32;
                            dot += (byte >> 4) as i32 * xq[j + 16] as i32;
                        }
                        acc += half(row, at) * acts.d[xb] * dot as f32
                            + half(row, at + 2) * acts.s[xb];
                    }
                    QuantFormat::Q8_0 => {
                        let mut dot = 0i32;
                        for j in 0..BLOCK {
                            dot += (row[at + 2 + j] as i8) as i32 * xq[j] as i32;
                        }
                        acc += half(row, at) * acts.d[xb] * dot as f32;
                    }
                    QuantFormat::Q6_K => acc += q6_k_block(row, b, xq, acts.d[xb]),
                    QuantFormat::Q4_K => acc += q4_k_block(row, b, xq, acts.d[xb], acts.s[xb]),
                }
            }
            let bias = args.bias.map_or(0.0, |b| b[col]);
            *out.add(i * args.n + col) = acc + bias;
        }
    }
}

/// The dot product of a Q6_K row's 32-value block `b` (of the whole row)
/// and one activation block (`xq`, scale `dx`): each half of 16 as an
/// integer sum of (q - 32) x, times d * scale * dx (the vector kernels'
/// terms, their float steps in another order).
fn q6_k_block(row: &[u8], b: usize, xq: &[i8], dx: f32) -> f32 {
    let per = SUPER_BLOCK / BLOCK;
    let block = &row[b / per * Q6_K_BYTES..(b / per + 1) * Q6_K_BYTES];
    let d = half(block, Q6_K_D);
    let mut acc = 0f32;
    for h in 0..2 {
        let first = b % per * BLOCK + 16 * h;
        let dot: i32 = (0..16)
            .map(|i| (i32::from(q6_k_value(block, first + i)) - 32) * i32::from(xq[16 * h + i]))
            .sum();
        let scale = d * f32::from(block[Q6_K_SCALES + first / 16] as i8);
        acc += dot as f32 * (scale * dx);
    }
    acc
}

/// The dot product of a Q4_K row's 32-value block `b` (of the whole row)
/// and one activation block (`xq`, scale `dx`, `sx` = dx * sum(xq)): the
/// integer sum of q x times d * scale * dx, less dmin * min * sx (the
/// vector kernels' terms).
fn q4_k_block(row: &[u8], b: usize, xq: &[i8], dx: f32, sx: f32) -> f32 {
    let per = SUPER_BLOCK / BLOCK;
    let block = &row[b / per * Q4_K_BYTES..(b / per + 1) * Q4_K_BYTES];
    let j = b % per;
    let dot: i32 = (0..BLOCK)
        .map(|i| i32::from(q4_k_value(block, BLOCK * j + i)) * i32::from(xq[i]))
        .sum();
    let (scale, min) = q4_k_scale_min(block, j);
    let (d, dmin) = (half(block, 0), half(block, 2));
    dot as f32 * (d * f32::from(scale) * dx) - dmin * f32::from(min) * sx
}

#[cfg(test)]
#[path = "quant_matmul_tests.rs"]
mod tests;
