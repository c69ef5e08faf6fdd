//! The block matmul of many rows on AMX tiles (Intel Xeon from Sapphire
//! Rapids on): each thread dequantizes its columns' panels once per call to
//! bfloat16, in the layout `tdpbf16ps` reads, and multiplies every row's
//! bfloat16 activations by them, sums in float32 tiles over the whole K.
//!
//! The integer kernels quantize each 32 activations to signed bytes and
//! scale every block's integer sum in float arithmetic; per block, that
//! float step costs about as much as the tile instruction that would take
//! its integer sums (an AMX-INT8 kernel measured 0.6-1.2x the VNNI one).
//! In bfloat16 the weights' scales are inside the values, so one tile
//! instruction takes 32 inputs of 16 rows and 16 columns with nothing after
//! it, and the tile unit runs at several times the VNNI kernel's rate.
//!
//! Numerics: a weight is its block's `d * q (+ m)` in float32 (in Q4_K and
//! Q6_K, with its 32- or 16-value block's scale and min: every format the
//! integer kernels take) rounded to bfloat16 (8 significant bits; the Q4_1
//! grid's values and Q8_0's whole bytes times a float16 scale mostly need
//! more), an activation rounded to bfloat16 (where the integer kernels keep
//! 8 bits a 32-value block under one shared scale), products summed in
//! float32. So a row's result differs from the integer kernels' by about
//! their own rounding, and a call takes this path by its row count
//! (`min_rows`): the default `quant_matmul` does, `quant_matmul_invariant`
//! never does (a row's bits then do not depend on its batch).
//!
//! A gated MLP's gate/up projection (`quant_matmul_gated`) pairs each gate
//! panel with its up panel, so that a 32-row block's four sum tiles are a
//! gate's and an up's sixteen columns: they go through the activation on
//! their way out of the tiles, and only act(gate) * up reaches memory.
//!
//! Linux gives a process the tiles' 8 KiB of register state only when it
//! asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), once, at the first call.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use crate::activation::{gate_row, Gate};
use crate::isa::Isa;
use crate::pool::run_parts_on;
use crate::quant_matmul::{OutPtr, QuantFormat, QuantMatmulArgs, BLOCK, SUPER_BLOCK};
use crate::quant_pack::{BlockLayout, PANEL};

/// Calls of fewer rows take the integer kernels. By `benches/quant_matmul.rs`
/// (SmolLM2-135M's layers and LM head), 32 rows is about where the tiles
/// start to pay (0.93-1.24x the VNNI kernel over two runs; at 16 a padded
/// call was no faster), and from 64 they win on every shape.
pub const MIN_ROWS: usize = 32;

/// The same for Q4_K and Q6_K, whose VNNI kernel runs more multiply-adds a
/// cycle and whose panels cost more to dequantize: by the same bench (a
/// Q4_K 1024 -> 2560 projection, a Q6_K 1024 -> 49152 LM head), the tiles
/// ran 0.70x and 0.87x the VNNI kernel at 32 rows, and 1.07-1.25x at 64,
/// 1.55-1.81x at 128 over two runs (docs/performance.md, "The K-quants on
/// the tiles").
pub const MIN_ROWS_K_QUANTS: usize = 64;

/// The fewest rows a call of `fmt` takes the tiles for.
pub fn min_rows(fmt: QuantFormat) -> usize {
    match fmt {
        QuantFormat::Q4_1 | QuantFormat::Q8_0 => MIN_ROWS,
        QuantFormat::Q4_K | QuantFormat::Q6_K => MIN_ROWS_K_QUANTS,
    }
}

/// Rows of a tile (activations, sums).
const TILE_ROWS: usize = 16;
/// Bytes of one tile: 16 rows of 64 (every tile of this kernel).
const TILE_BYTES: usize = TILE_ROWS * 64;
/// Rows a thread takes its columns over at once: their activations (at
/// most 192 KiB for K = 1536) and its panels stay in the core's cache (32
/// to 1024 measured within a tenth of each other, 64 as good as any).
const ROW_CHUNK: usize = 64;
/// Column parts per thread (claimed as threads come free).
const PARTS_PER_THREAD: usize = 4;

/// Whether this CPU has AMX-BF16 (with AVX-512 BF16, BW and F), the cap
/// allows it (`FERROX_CPU_ISA` unset or `amx`) and the OS gave this process
/// the tiles' state.
pub fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        crate::isa::cap() >= Isa::Amx
            && crate::isa::avx512()
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512bf16")
            && cpu_has_amx_bf16()
            && request_tiles()
    })
}

/// Whether the default `quant_matmul` takes this call to the tiles.
pub(crate) fn takes(args: &QuantMatmulArgs<'_>) -> bool {
    args.m >= min_rows(args.fmt) && args.n >= PANEL && supported()
}

/// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); and the OS
/// saves the tile state (XCR0 bits 17 and 18, with OSXSAVE).
fn cpu_has_amx_bf16() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU; XGETBV runs only when CPUID
    // says the OS enabled it (OSXSAVE).
    unsafe {
        let leaf7 = __cpuid_count(7, 0);
        let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
        let amx = (1 << 22) | (1 << 24);
        if leaf7.edx & amx != amx || !osxsave {
            return false;
        }
        let (lo, _hi): (u32, u32);
        asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") _hi, options(nomem, nostack));
        lo & (3 << 17) == 3 << 17
    }
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`,
/// `XFEATURE_XTILEDATA`; granted to the whole process); true when granted.
fn request_tiles() -> bool {
    #[cfg(target_os = "linux")]
    {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: a system call that only changes what the process may use.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack)
            );
        }
        ret == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// A tile configuration (palette 1): each tile's rows and bytes a row.
/// This kernel's: eight tiles of 16 rows of 64 bytes, tmm0-3 the sums of
/// two row tiles by two column tiles, tmm4-5 the rows' activations, tmm6-7
/// the columns' weights.
#[repr(C, align(64))]
pub(crate) struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        Self::with_shapes([(TILE_ROWS as u8, 64); 8])
    }

    /// Tile t: `shapes[t]` = (rows, bytes a row).
    pub(crate) fn with_shapes(shapes: [(u8, u16); 8]) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for (t, (rows, bytes)) in shapes.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = rows;
        }
        Self(c)
    }

    /// Makes this the thread's configuration (the tiles start at zero).
    ///
    /// # Safety
    /// `supported()`.
    #[inline(always)]
    pub(crate) unsafe fn load(&self) {
        asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly));
    }
}

/// 64-byte-aligned bytes, reused by a thread from one call to the next.
#[derive(Default)]
struct Aligned(Vec<__m512i>);

impl Aligned {
    fn bytes(&mut self, len: usize) -> *mut u8 {
        let vectors = len.div_ceil(64);
        if self.0.len() < vectors {
            // SAFETY: an all-zero __m512i is a valid value.
            self.0.resize(vectors, unsafe { _mm512_setzero_si512() });
        }
        self.0.as_mut_ptr() as *mut u8
    }
}

thread_local! {
    /// A part's dequantized panels.
    static PANELS: RefCell<Aligned> = RefCell::default();
    /// The calling thread's bfloat16 activations.
    static ROWS: RefCell<Aligned> = RefCell::default();
}

/// out[M, N] = x @ dequant(w)^T (+ bias) on the tiles; with `gate`, the
/// gated MLP's activation of those sums instead: out[M, N / 2] =
/// act(gate) * up, gate the first N / 2 columns, up the last.
///
/// # Safety
/// `supported()`; the shapes are checked (`out` holds M * N floats, or M *
/// N / 2 with `gate`, `w` N columns of K inputs in `args.layout`);
/// with `gate`, N / 2 is a multiple of 16.
pub(crate) unsafe fn matmul(args: &QuantMatmulArgs<'_>, gate: Option<Gate>, out: &mut [f32]) {
    let (m, k) = (args.m, args.k);
    let padded = m.next_multiple_of(2 * TILE_ROWS);
    ROWS.with_borrow_mut(|rows| {
        let x16 = rows.bytes(padded * k * 2) as *mut u16;
        let x16 = SendPtr(x16);
        // The activations to bfloat16, rows split between the threads (the
        // padding rows zero: their sums are computed and dropped).
        let per = ROW_CHUNK;
        run_parts_on(args.num_threads, padded.div_ceil(per), &|part| {
            let (first, last) = (part * per, ((part + 1) * per).min(padded));
            // SAFETY: rows first..last of the buffer, which holds `padded`.
            unsafe { to_bf16(args.x, m, k, first, last, x16.get()) };
        });
        // Column parts in pairs of panels (32 columns, the kernel's width):
        // with `gate`, a gate panel and its up panel, so the parts split
        // the gate's columns.
        let (whole, unit) = match gate {
            Some(_) => (args.n / 2, PANEL),
            None => (args.n / PANEL * PANEL, 2 * PANEL),
        };
        let parts = (args.num_threads.max(1) * PARTS_PER_THREAD).clamp(1, whole.div_ceil(unit));
        let per = whole.div_ceil(unit).div_ceil(parts) * unit;
        let parts = whole.div_ceil(per);
        let ptr = OutPtr(out.as_mut_ptr());
        run_parts_on(args.num_threads, parts, &|part| {
            let (start, end) = (part * per, ((part + 1) * per).min(whole));
            // SAFETY: columns start..end of `out` are this part's alone;
            // the caller's contract covers the rest.
            unsafe { columns(args, x16.get(), padded, start, end, gate, ptr) };
        });
        if gate.is_none() && whole < args.n {
            // The last N % 16 columns (llama.cpp's rows layout) on the
            // integer kernel.
            let chunks = crate::quant_matmul::RowChunks::new(args);
            let kernel = crate::quant_matmul::QuantKernel::best();
            unsafe { chunks.run_columns(kernel, whole, args.n, ptr) };
        }
    });
}

/// One call's activations in bfloat16 tile order (`tile_at`), its rows
/// padded to a multiple of 32 with zeros, for `run_columns`: what the MoE
/// experts' call makes for each expert that takes the tiles.
pub(crate) struct TileRows {
    buffer: Aligned,
    padded: usize,
}

impl TileRows {
    /// `args.x` converted on the calling thread.
    ///
    /// # Safety
    /// `supported()`; `args.x` holds M rows of K (a multiple of 32).
    pub(crate) unsafe fn new(args: &QuantMatmulArgs<'_>) -> Self {
        let padded = args.m.next_multiple_of(2 * TILE_ROWS);
        let mut buffer = Aligned::default();
        let x16 = buffer.bytes(padded * args.k * 2) as *mut u16;
        to_bf16(args.x, args.m, args.k, 0, padded, x16);
        Self { buffer, padded }
    }

    /// Columns `start..end` of every row of `out`, `start` and `end`
    /// multiples of 16 (whole panels).
    ///
    /// # Safety
    /// As `columns`: `out` holds M * N floats whose columns start..end no
    /// other thread writes; `args` is the one these rows were made from.
    pub(crate) unsafe fn run_columns(
        &self,
        args: &QuantMatmulArgs<'_>,
        start: usize,
        end: usize,
        out: OutPtr,
    ) {
        let x16 = self.buffer.0.as_ptr() as *const u16;
        columns(args, x16, self.padded, start, end, None, out);
    }
}

#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Where element `j` of activation row `r` goes in the bfloat16 buffer (in
/// 16-bit units): tile after tile, each sixteen rows' 32 inputs of one
/// block (1 KiB), the tiles of one row group in K order, so that a tile
/// loads from one contiguous kilobyte (1.02-1.09x the speed of rows `k`
/// apart, by hand on this kernel's shapes).
#[inline(always)]
fn tile_at(r: usize, j: usize, k: usize) -> usize {
    ((r / TILE_ROWS * (k / BLOCK) + j / BLOCK) * TILE_ROWS + r % TILE_ROWS) * BLOCK + j % BLOCK
}

/// Rows `first..last` of `x` ([m, k] float32) as bfloat16 (round to nearest
/// even) at `out` (laid out by `tile_at`), rows from `m` on zero.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn to_bf16(x: &[f32], m: usize, k: usize, first: usize, last: usize, out: *mut u16) {
    for r in first..last {
        if r >= m {
            for j in (0..k).step_by(BLOCK) {
                _mm512_storeu_si512(
                    out.add(tile_at(r, j, k)) as *mut __m512i,
                    _mm512_setzero_si512(),
                );
            }
            continue;
        }
        let row = x.as_ptr().add(r * k);
        for j in (0..k).step_by(BLOCK) {
            let lo = _mm512_loadu_ps(row.add(j));
            let hi = _mm512_loadu_ps(row.add(j + 16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.add(tile_at(r, j, k)) as *mut __m512i, v);
        }
    }
}

/// Columns `start..end` (whole panels) of every row of `out`; with `gate`,
/// gate columns `start..end` and their up columns, activated.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,f16c")]
unsafe fn columns(
    args: &QuantMatmulArgs<'_>,
    x16: *const u16,
    padded: usize,
    start: usize,
    end: usize,
    gate: Option<Gate>,
    out: OutPtr,
) {
    let blocks = args.k / BLOCK;
    let panels = (end - start) / PANEL;
    let panel_tiles = blocks * TILE_BYTES; // one panel's dequantized bytes
    let row_bytes = args.fmt.row_bytes(args.k);
    let inter = args.n / 2;
    // The weight column of buffer panel i: this part's panels in order, or
    // with `gate` its gate panels, then their up panels.
    let source = |i: usize| match gate {
        Some(_) if i >= panels => inter + start + (i - panels) * PANEL,
        _ => start + i * PANEL,
    };
    // Pair q: its two buffer panels (the second one the first again where a
    // part's panel count is odd), whether they differ, and the output
    // column of its first.
    let (pairs, out_n) = match gate {
        Some(_) => (panels, inter),
        None => (panels.div_ceil(2), args.n),
    };
    let pair = |q: usize| match gate {
        Some(_) => (q, panels + q, true, start + q * PANEL),
        None => {
            let second = (2 * q + 1).min(panels - 1);
            (2 * q, second, second != 2 * q, start + 2 * q * PANEL)
        }
    };
    let buffered = if gate.is_some() { 2 * panels } else { panels };
    PANELS.with_borrow_mut(|buffer| {
        let weights = buffer.bytes(buffered * panel_tiles);
        let mut packed = Vec::new();
        // Panel i's tiles, written by the first row chunk as it reaches
        // them (then in the core's L1 cache for that chunk's rows), read
        // back by the others.
        let mut dequantize = |i: usize| {
            let col = source(i);
            let at = match args.layout {
                BlockLayout::Panels => args.w.as_ptr().add(col * row_bytes),
                BlockLayout::Rows => {
                    packed.resize(PANEL * row_bytes, 0);
                    crate::quant_matmul_panel::pack_panel(args, col, &mut packed);
                    packed.as_ptr()
                }
            };
            dequantize_panel(args.fmt, at, blocks, weights.add(i * panel_tiles));
        };
        // one bias tile per buffer panel
        let bias = args.bias.map(|b| {
            let mut tiles = bias_tiles(&b[start..end]);
            if gate.is_some() {
                tiles.extend(bias_tiles(&b[inter + start..inter + end]));
            }
            tiles
        });
        TileConfig::new().load();
        let c_stride = out_n * 4;
        let mut edge = [0f32; 2 * TILE_ROWS * 2 * PANEL];
        for chunk in (0..padded).step_by(ROW_CHUNK) {
            for q in 0..pairs {
                let (p0, p1, two, col) = pair(q);
                if chunk == 0 {
                    dequantize(p0);
                    if two {
                        dequantize(p1);
                    }
                }
                let w0 = weights.add(p0 * panel_tiles);
                let w1 = weights.add(p1 * panel_tiles);
                for r in (chunk..(chunk + ROW_CHUNK).min(padded)).step_by(2 * TILE_ROWS) {
                    // rows r.. and r + 16.. (`tile_at`)
                    let a0 = x16.add(tile_at(r, 0, args.k)) as *const u8;
                    let a1 = a0.add(blocks * TILE_BYTES);
                    match &bias {
                        Some(b) => {
                            let b0 = b.as_ptr().add(p0 * TILE_ROWS * PANEL) as *const u8;
                            let b1 = b.as_ptr().add(p1 * TILE_ROWS * PANEL) as *const u8;
                            asm!(
                                "tileloadd tmm0, [{b0} + {s} * 1]",
                                "tileloadd tmm1, [{b1} + {s} * 1]",
                                "tileloadd tmm2, [{b0} + {s} * 1]",
                                "tileloadd tmm3, [{b1} + {s} * 1]",
                                b0 = in(reg) b0,
                                b1 = in(reg) b1,
                                s = in(reg) 64usize,
                                options(nostack, readonly),
                            );
                        }
                        None => asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            options(nostack, nomem),
                        ),
                    }
                    for b in 0..blocks {
                        asm!(
                            "tileloadd tmm4, [{a0} + {sa} * 1]",
                            "tileloadd tmm6, [{w0} + {sw} * 1]",
                            "tileloadd tmm5, [{a1} + {sa} * 1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tileloadd tmm7, [{w1} + {sw} * 1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a0 = in(reg) a0.add(b * TILE_BYTES),
                            a1 = in(reg) a1.add(b * TILE_BYTES),
                            sa = in(reg) 64usize,
                            w0 = in(reg) w0.add(b * TILE_BYTES),
                            w1 = in(reg) w1.add(b * TILE_BYTES),
                            sw = in(reg) 64usize,
                            options(nostack, readonly),
                        );
                    }
                    let rows = (args.m.saturating_sub(r)).min(2 * TILE_ROWS);
                    let width = if two { 2 * PANEL } else { PANEL };
                    if let Some(gate) = gate {
                        if rows > 0 {
                            store_gated(
                                gate,
                                &mut edge,
                                rows,
                                out.get().add(r * out_n + col),
                                out_n,
                            );
                        }
                    } else if rows == 2 * TILE_ROWS && two {
                        let c = out.get().add(r * out_n + col) as *mut u8;
                        store_sums(c, c_stride);
                    } else if rows > 0 {
                        // A partial row tile or a lone panel: through a
                        // buffer of 32 rows by 32 columns.
                        store_sums(edge.as_mut_ptr() as *mut u8, 2 * PANEL * 4);
                        for i in 0..rows {
                            std::ptr::copy_nonoverlapping(
                                edge.as_ptr().add(i * 2 * PANEL),
                                out.get().add((r + i) * out_n + col),
                                width,
                            );
                        }
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    });
}

/// The four sums' tiles (tmm0-3: rows 0-15 and 16-31 by columns 0-15 and
/// 16-31) into float32 rows `stride` bytes apart at `c`.
///
/// # Safety
/// The tiles are configured and hold sums; `c` has 32 such rows of 32
/// floats.
#[inline(always)]
unsafe fn store_sums(c: *mut u8, stride: usize) {
    asm!(
        "tilestored [{c0} + {s} * 1], tmm0",
        "tilestored [{c1} + {s} * 1], tmm1",
        "tilestored [{c2} + {s} * 1], tmm2",
        "tilestored [{c3} + {s} * 1], tmm3",
        c0 = in(reg) c,
        c1 = in(reg) c.add(64),
        c2 = in(reg) c.add(TILE_ROWS * stride),
        c3 = in(reg) c.add(TILE_ROWS * stride + 64),
        s = in(reg) stride,
        options(nostack),
    );
}

/// The four sums' tiles of a gate panel (tmm0, tmm2: rows 0-15 and 16-31)
/// and its up panel (tmm1, tmm3), activated: `rows` rows of 16 values,
/// `stride` floats apart, at `out`. `scratch`: 32 x 32 floats.
///
/// # Safety
/// The tiles are configured and hold sums; `out` has `rows` such rows.
#[inline(always)]
unsafe fn store_gated(
    gate: Gate,
    scratch: &mut [f32; 2 * TILE_ROWS * 2 * PANEL],
    rows: usize,
    out: *mut f32,
    stride: usize,
) {
    // gate sums in the first half (row i at 16 i), up sums in the second
    let half = TILE_ROWS * 2 * PANEL;
    let (g, u) = scratch.split_at_mut(half);
    let (g, u) = (g.as_mut_ptr() as *mut u8, u.as_mut_ptr() as *mut u8);
    asm!(
        "tilestored [{g0} + {s} * 1], tmm0",
        "tilestored [{g1} + {s} * 1], tmm2",
        "tilestored [{u0} + {s} * 1], tmm1",
        "tilestored [{u1} + {s} * 1], tmm3",
        g0 = in(reg) g,
        g1 = in(reg) g.add(TILE_BYTES),
        u0 = in(reg) u,
        u1 = in(reg) u.add(TILE_BYTES),
        s = in(reg) 64usize,
        options(nostack),
    );
    let (g, u) = scratch.split_at_mut(half);
    let values = rows * PANEL;
    // act(gate) * up, then each row to its place
    let mut act = [0f32; TILE_ROWS * 2 * PANEL];
    gate_row(gate, &g[..values], &u[..values], &mut act[..values]);
    for i in 0..rows {
        std::ptr::copy_nonoverlapping(act.as_ptr().add(i * PANEL), out.add(i * stride), PANEL);
    }
}

/// The bias of a part's columns as tiles, one per panel: 16 rows, each the
/// panel's 16 biases (the starting sums of every row).
fn bias_tiles(bias: &[f32]) -> Vec<f32> {
    let mut tiles = Vec::with_capacity(bias.len() * TILE_ROWS);
    for panel in bias.chunks_exact(PANEL) {
        for _ in 0..TILE_ROWS {
            tiles.extend_from_slice(panel);
        }
    }
    tiles
}

/// Two vectors of sixteen columns' weights (inputs 2i and 2i + 1) as one
/// tile row: each column's two bfloat16 values side by side.
#[inline(always)]
unsafe fn pair_row(even: __m512, odd: __m512, interleave: __m512i, at: *mut u8) {
    // low half the even inputs, high half the odd ones
    let halves: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(odd, even));
    _mm512_store_si512(
        at as *mut __m512i,
        _mm512_permutexvar_epi16(interleave, halves),
    );
}

/// One panel's `blocks` blocks of 32 inputs (packed layout) as bfloat16
/// tiles at `out`: block b's tile row i holds inputs 32b + 2i and 32b + 2i +
/// 1 of each of the sixteen columns. Each weight is the float32 value the
/// scalar `dequantize_block` computes, rounded to bfloat16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,f16c")]
unsafe fn dequantize_panel(fmt: QuantFormat, panel: *const u8, blocks: usize, out: *mut u8) {
    let interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    let (panel_block, scales) = (fmt.panel_block_bytes(), fmt.panel_scales_at());
    let group = 4 * PANEL;
    if matches!(fmt, QuantFormat::Q4_K | QuantFormat::Q6_K) {
        // super-blocks of eight tiles
        let tiles = SUPER_BLOCK / BLOCK;
        for sb in 0..blocks / tiles {
            let (p, o) = (
                panel.add(sb * panel_block),
                out.add(sb * tiles * TILE_BYTES),
            );
            match fmt {
                QuantFormat::Q4_K => q4_k_tiles(p, scales, interleave, o),
                _ => q6_k_tiles(p, scales, interleave, o),
            }
        }
        return;
    }
    for b in 0..blocks {
        let p = panel.add(b * panel_block);
        let o = out.add(b * TILE_BYTES);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(scales) as *const __m256i));
        match fmt {
            QuantFormat::Q8_0 => {
                // group g: inputs 4g..4g + 4 of each column, a byte each
                for g in 0..8 {
                    let v = _mm512_loadu_si512(p.add(g * group) as *const __m512i);
                    let byte = |q: __m512i| _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
                    let w0 = byte(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(v)));
                    let w1 = byte(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(v)));
                    let w2 = byte(_mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(v)));
                    let w3 = byte(_mm512_srai_epi32::<24>(v));
                    pair_row(w0, w1, interleave, o.add(2 * g * 64));
                    pair_row(w2, w3, interleave, o.add((2 * g + 1) * 64));
                }
            }
            QuantFormat::Q4_1 => {
                // group g: bytes 4g..4g + 4 of each column, the low nibbles
                // inputs 4g.., the high ones 16 + 4g..
                let m = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(scales + 32) as *const __m256i));
                let mask = _mm512_set1_epi32(0x0f);
                for g in 0..4 {
                    let v = _mm512_loadu_si512(p.add(g * group) as *const __m512i);
                    let nibble = |q: __m512i| {
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, mask)), d, m)
                    };
                    let lo = [
                        nibble(v),
                        nibble(_mm512_srli_epi32::<8>(v)),
                        nibble(_mm512_srli_epi32::<16>(v)),
                        nibble(_mm512_srli_epi32::<24>(v)),
                    ];
                    let hi = [
                        nibble(_mm512_srli_epi32::<4>(v)),
                        nibble(_mm512_srli_epi32::<12>(v)),
                        nibble(_mm512_srli_epi32::<20>(v)),
                        nibble(_mm512_srli_epi32::<28>(v)),
                    ];
                    pair_row(lo[0], lo[1], interleave, o.add(2 * g * 64));
                    pair_row(lo[2], lo[3], interleave, o.add((2 * g + 1) * 64));
                    pair_row(hi[0], hi[1], interleave, o.add((8 + 2 * g) * 64));
                    pair_row(hi[2], hi[3], interleave, o.add((8 + 2 * g + 1) * 64));
                }
            }
            QuantFormat::Q6_K | QuantFormat::Q4_K => unreachable!("super-blocks, above"),
        }
    }
}

/// Byte `b` (0..4) of each of the sixteen 32-bit lanes, shifted right by
/// `extra` bits more, masked by `mask`.
#[inline(always)]
unsafe fn lane_bits(v: __m512i, b: u32, extra: u32, mask: i32) -> __m512i {
    let shifted = _mm512_srlv_epi32(v, _mm512_set1_epi32((8 * b + extra) as i32));
    _mm512_and_si512(shifted, _mm512_set1_epi32(mask))
}

/// A Q4_K panel block (super-block: 256 inputs of sixteen columns) as eight
/// tiles at `o`: three groups of the columns' twelve scale bytes, then 32
/// groups of nibble bytes (per 64 inputs, eight groups: the low nibbles are
/// 32-input block 2i, the high ones block 2i + 1), then `d` and `dmin` at
/// `scales`. A weight is (d * scale) * q - dmin * min.
#[inline(always)]
unsafe fn q4_k_tiles(p: *const u8, scales: usize, interleave: __m512i, o: *mut u8) {
    let group = 4 * PANEL;
    let load = |g: usize| _mm512_loadu_si512(p.add(g * group) as *const __m512i);
    let (s0, s1, s2) = (load(0), load(1), load(2));
    let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(scales) as *const __m256i));
    let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(scales + 32) as *const __m256i));
    // block j's 6-bit scale and min (`quant_matmul::q4_k_scale_min`)
    let scale_min = |j: u32| {
        let (scale, min) = if j < 4 {
            (lane_bits(s0, j, 0, 63), lane_bits(s1, j, 0, 63))
        } else {
            let t = j - 4;
            let high = |v: __m512i| _mm512_slli_epi32::<4>(lane_bits(v, t, 6, 3));
            (
                _mm512_or_si512(lane_bits(s2, t, 0, 0x0f), high(s0)),
                _mm512_or_si512(lane_bits(s2, t, 4, 0x0f), high(s1)),
            )
        };
        (
            _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale)),
            _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(min)),
        )
    };
    for i in 0..4u32 {
        let (ds_lo, dm_lo) = scale_min(2 * i);
        let (ds_hi, dm_hi) = scale_min(2 * i + 1);
        let (tile_lo, tile_hi) = (
            o.add(2 * i as usize * TILE_BYTES),
            o.add((2 * i as usize + 1) * TILE_BYTES),
        );
        for g in 0..8 {
            let v = load(3 + 8 * i as usize + g);
            let value = |b: u32, extra: u32, ds: __m512, dm: __m512| {
                let q = _mm512_cvtepi32_ps(lane_bits(v, b, extra, 0x0f));
                _mm512_sub_ps(_mm512_mul_ps(q, ds), dm)
            };
            let lo = |b: u32| value(b, 0, ds_lo, dm_lo);
            let hi = |b: u32| value(b, 4, ds_hi, dm_hi);
            // inputs 4g..4g + 4 of each block: tile rows 2g and 2g + 1
            pair_row(lo(0), lo(1), interleave, tile_lo.add(2 * g * 64));
            pair_row(lo(2), lo(3), interleave, tile_lo.add((2 * g + 1) * 64));
            pair_row(hi(0), hi(1), interleave, tile_hi.add(2 * g * 64));
            pair_row(hi(2), hi(3), interleave, tile_hi.add((2 * g + 1) * 64));
        }
    }
}

/// A Q6_K panel block (super-block) as eight tiles at `o`: per half n of
/// 128 inputs and g of 8, the groups of `ql` bytes 64n + 4g and 64n + 32 +
/// 4g and of `qh` bytes 32n + 4g (`quant_pack::q6_k_slot`), then the sixteen
/// signed scale bytes of each column, then `d` at `scales`. Input l + 32j of
/// a half (block 4n + j) takes the first `ql` group's nibbles for j = 0, 2,
/// the second's for 1, 3 (the low nibble for j < 2), and `qh` bits 2j; a
/// weight is (d * scale) * (q - 32), scale i / 16 of the super-block.
#[inline(always)]
unsafe fn q6_k_tiles(p: *const u8, scales: usize, interleave: __m512i, o: *mut u8) {
    let group = 4 * PANEL;
    let load = |g: usize| _mm512_loadu_si512(p.add(g * group) as *const __m512i);
    let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(scales) as *const __m256i));
    // d times each of the sixteen 16-value blocks' signed scales, once
    let singles = scales - PANEL * PANEL;
    let ds: [__m512; 16] = std::array::from_fn(|i| {
        let bytes = _mm_loadu_si128(p.add(singles + PANEL * i) as *const __m128i);
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)))
    });
    let offset = _mm512_set1_epi32(32);
    for n in 0..2usize {
        for g in 0..8usize {
            let slot = 3 * (8 * n + g);
            let (a, b, h) = (load(slot), load(slot + 1), load(slot + 2));
            for j in 0..4u32 {
                let ql = if j & 1 == 0 { a } else { b };
                let ds = ds[8 * n + 2 * j as usize + usize::from(g >= 4)];
                let value = |byte: u32| {
                    let low = lane_bits(ql, byte, 4 * (j >> 1), 0x0f);
                    let high = _mm512_slli_epi32::<4>(lane_bits(h, byte, 2 * j, 3));
                    let q = _mm512_sub_epi32(_mm512_or_si512(low, high), offset);
                    _mm512_mul_ps(ds, _mm512_cvtepi32_ps(q))
                };
                let tile = o.add((4 * n + j as usize) * TILE_BYTES);
                pair_row(value(0), value(1), interleave, tile.add(2 * g * 64));
                pair_row(value(2), value(3), interleave, tile.add((2 * g + 1) * 64));
            }
        }
    }
}
