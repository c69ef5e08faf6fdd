//! Fused element-wise CPU kernels of the decoder layer, in float32: rotary
//! position embedding in place, and residual add + RMS normalisation. Each
//! replaces several separate tensor operations (and their memory passes).

use crate::paged_attention::ShapeError;

macro_rules! check {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(ShapeError(format!($($arg)+)));
        }
    };
}

/// Below this many elements a kernel runs on the calling thread only.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Runs `work` over `rows` rows of `row_len` floats, split into contiguous
/// runs across up to `num_threads` threads.
fn for_row_runs<F>(data: &mut [f32], row_len: usize, num_threads: usize, work: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let rows = data.len() / row_len.max(1);
    let threads = if data.len() < PARALLEL_MIN_ELEMENTS {
        1
    } else {
        num_threads.clamp(1, rows.max(1))
    };
    if threads == 1 {
        work(0, data);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, chunk) in data.chunks_mut(per * row_len).enumerate() {
            let work = &work;
            s.spawn(move || work(i * per, chunk));
        }
    });
}

/// Rotates the first `num_heads` heads of every token of `x` ([T, row heads,
/// D], row-major) in place: the half-split layout, x1' = x1 cos - x2 sin and
/// x2' = x2 cos + x1 sin, with cos/sin rows ([max_position, D/2]) chosen by
/// each token's position.
#[allow(clippy::too_many_arguments)]
pub fn rotary_in_place(
    x: &mut [f32],
    row_len: usize,
    num_heads: usize,
    head_dim: usize,
    positions: &[i64],
    cos: &[f32],
    sin: &[f32],
    num_threads: usize,
) -> Result<(), ShapeError> {
    let heads = RotaryHeads {
        row_len,
        num_heads,
        head_dim,
        rotary_dim: head_dim,
    };
    rotary_partial_in_place(x, &heads, positions, cos, sin, num_threads)
}

/// Where the heads a rotary embedding turns lie in a row.
pub struct RotaryHeads {
    pub row_len: usize,
    pub num_heads: usize,
    /// Each head's width: its stride in the row.
    pub head_dim: usize,
    /// The leading dimensions of each head that rotate (the half-split layout
    /// over them); the rest pass (a partial rotary embedding).
    pub rotary_dim: usize,
}

/// `rotary_in_place` over the first `rotary_dim` dimensions of each head
/// only; cos/sin are [max_position, rotary_dim / 2].
pub fn rotary_partial_in_place(
    x: &mut [f32],
    heads: &RotaryHeads,
    positions: &[i64],
    cos: &[f32],
    sin: &[f32],
    num_threads: usize,
) -> Result<(), ShapeError> {
    let RotaryHeads {
        row_len,
        num_heads,
        head_dim,
        rotary_dim,
    } = *heads;
    let half = rotary_dim / 2;
    check!(
        rotary_dim.is_multiple_of(2) && rotary_dim > 0 && rotary_dim <= head_dim,
        "the rotary dimensions must be even, in (0, head_dim]"
    );
    check!(
        num_heads * head_dim <= row_len,
        "more heads than a row holds"
    );
    check!(
        x.len() == positions.len() * row_len,
        "x is not [T, {row_len}]"
    );
    check!(
        cos.len() == sin.len() && cos.len().is_multiple_of(half),
        "cos/sin are not [P, rotary_dim/2]"
    );
    let max_pos = (cos.len() / half) as i64;
    if let Some(&p) = positions.iter().find(|&&p| p < 0 || p >= max_pos) {
        return Err(ShapeError(format!("position {p} outside [0, {max_pos})")));
    }
    for_row_runs(x, row_len, num_threads, |first, rows| {
        for (i, row) in rows.chunks_exact_mut(row_len).enumerate() {
            let p = positions[first + i] as usize;
            let (c, s) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            for head in row[..num_heads * head_dim].chunks_exact_mut(head_dim) {
                let (x1, x2) = head[..rotary_dim].split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (x1[j], x2[j]);
                    x1[j] = a * c[j] - b * s[j];
                    x2[j] = b * c[j] + a * s[j];
                }
            }
        }
    });
    Ok(())
}

/// For each row: `residual += delta` (when `delta` is given), then
/// `out = weight * residual / sqrt(mean(residual^2) + eps)`.
pub fn add_rms_norm(
    residual: &mut [f32],
    delta: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), ShapeError> {
    let hidden = weight.len();
    check!(
        hidden > 0 && residual.len().is_multiple_of(hidden),
        "rows are not [T, {hidden}]"
    );
    check!(
        out.len() == residual.len(),
        "out and residual differ in size"
    );
    if let Some(d) = delta {
        check!(
            d.len() == residual.len(),
            "delta and residual differ in size"
        );
    }
    let threads = if residual.len() < PARALLEL_MIN_ELEMENTS {
        1
    } else {
        num_threads.max(1)
    };
    let rows = residual.len() / hidden;
    let per = rows.div_ceil(threads) * hidden;
    let norm_rows = |res: &mut [f32], delta: Option<&[f32]>, out: &mut [f32]| {
        for (r, row) in res.chunks_exact_mut(hidden).enumerate() {
            if let Some(d) = delta {
                for (x, dx) in row.iter_mut().zip(&d[r * hidden..(r + 1) * hidden]) {
                    *x += dx;
                }
            }
            let mut lanes = [0.0f32; 8];
            let chunks = row.chunks_exact(8);
            let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
            for c in chunks {
                for l in 0..8 {
                    lanes[l] += c[l] * c[l];
                }
            }
            let mean = (lanes.iter().sum::<f32>() + tail) / hidden as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            for ((o, x), w) in out[r * hidden..(r + 1) * hidden]
                .iter_mut()
                .zip(row.iter())
                .zip(weight)
            {
                *o = w * (x * inv);
            }
        }
    };
    if threads == 1 {
        norm_rows(residual, delta, out);
        return Ok(());
    }
    std::thread::scope(|s| {
        let norm_rows = &norm_rows;
        for (i, (res, o)) in residual
            .chunks_mut(per)
            .zip(out.chunks_mut(per))
            .enumerate()
        {
            let d = delta.map(|d| &d[i * per..i * per + res.len()]);
            s.spawn(move || norm_rows(res, d, o));
        }
    });
    Ok(())
}

#[cfg(test)]
#[path = "elementwise_tests.rs"]
mod tests;
