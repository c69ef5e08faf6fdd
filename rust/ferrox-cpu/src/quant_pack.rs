//! Block weights packed into column panels, once, when a model loads.
//!
//! The block kernels multiply sixteen output columns (weight rows) at a
//! time: one vector holds four consecutive weights of each of the sixteen
//! columns, so that four activation bytes broadcast to every lane give the
//! sixteen partial dot products side by side. llama.cpp's row layout keeps
//! each column's block whole instead, and rearranging it costs about as
//! much as the multiply when few activation rows share the panel (a decode
//! step). `BlockLayout::Panels` stores the weight already rearranged: the
//! same bytes, in the order the kernels read them.
//!
//! ```text
//! rows layout   [N, K/32 blocks]          column c: block 0 | block 1 | ...
//! panels layout [N/16 panels, K/32, 16]   panel p, block b:
//!   q4_1  4 x 64 bytes   group g: bytes 4g..4g+4 of each column's 16 nibble bytes
//!         32 + 32 bytes  the sixteen scales, then the sixteen offsets (float16)
//!   q8_0  8 x 64 bytes   group g: weights 4g..4g+4 of each column (signed)
//!         32 bytes       the sixteen scales (float16)
//!   q6_k  (blocks of 256 weights: [N/16 panels, K/256, 16])
//!         48 x 64 bytes  groups of four of each column's 192 bytes of `ql`
//!                        then `qh`, in the order the kernels read them
//!                        (`q6_k_slot`)
//!         16 x 16 bytes  scale i of each column (signed bytes)
//!         32 bytes       the sixteen `d` (float16)
//!         (column c's four bytes at 4c within each 64-byte group)
//!   q4_k  (blocks of 256 weights: [N/16 panels, K/256, 16])
//!         3 x 64 bytes   the twelve bytes of 6-bit scales and mins
//!         32 x 64 bytes  groups of four of each column's 128 nibble bytes
//!         32 + 32 bytes  the sixteen `d`, then the sixteen `dmin` (float16)
//! then the last N % 16 columns in the rows layout.
//! ```
//!
//! A panel block is sixteen blocks' bytes, so both layouts have the same
//! size, and a row's result is the same bits in either (the kernels pack
//! a panel of a rows-layout weight per call into this layout, then run the
//! one loop).

use crate::quant_matmul::{check_k, QuantFormat, QuantShapeError};

/// Output columns per packed panel.
pub const PANEL: usize = 16;

/// How a block weight's columns are ordered in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockLayout {
    /// llama.cpp's: each column's blocks in a row.
    Rows,
    /// Panels of sixteen columns rearranged for the kernels (above).
    Panels,
}

impl QuantFormat {
    /// Bytes of one block of a panel (sixteen columns).
    pub fn panel_block_bytes(self) -> usize {
        PANEL * self.block_bytes()
    }

    /// Bytes of one packed weight group (four weights of sixteen columns).
    pub(crate) const GROUP_BYTES: usize = 4 * PANEL;

    /// Where the float16 scales of a panel block start (the weights' groups
    /// and Q6_K's byte scales before them).
    pub(crate) fn panel_scales_at(self) -> usize {
        let pieces = self.pieces();
        pieces.groups * Self::GROUP_BYTES + pieces.bytes * PANEL
    }

    fn pieces(self) -> Pieces {
        match self {
            QuantFormat::Q4_1 => Pieces {
                quants_at: 4,
                groups: 4,
                bytes_at: 0,
                bytes: 0,
                heads_at: 0,
                heads: 2,
            },
            QuantFormat::Q8_0 => Pieces {
                quants_at: 2,
                groups: 8,
                bytes_at: 0,
                bytes: 0,
                heads_at: 0,
                heads: 1,
            },
            // (the scale bytes and the nibbles follow d and dmin: one run
            // of 35 groups)
            QuantFormat::Q4_K => Pieces {
                quants_at: 4,
                groups: 35,
                bytes_at: 0,
                bytes: 0,
                heads_at: 0,
                heads: 2,
            },
            QuantFormat::Q6_K => Pieces {
                quants_at: 0,
                groups: 48,
                bytes_at: 192,
                bytes: 16,
                heads_at: 208,
                heads: 1,
            },
        }
    }
}

/// Where a block's bytes are (rows layout) and go (a panel block, in this
/// order): `groups` runs of 4 bytes from `quants_at`, `bytes` single bytes
/// from `bytes_at`, `heads` float16 values from `heads_at`.
struct Pieces {
    quants_at: usize,
    groups: usize,
    bytes_at: usize,
    bytes: usize,
    heads_at: usize,
    heads: usize,
}

/// Where column `c`'s bytes of a block sit in a panel block: (offset in the
/// rows-layout block, offset in the panel block, length) for each piece.
fn pieces(fmt: QuantFormat, c: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let g = QuantFormat::GROUP_BYTES;
    let Pieces {
        quants_at,
        groups,
        bytes_at,
        bytes,
        heads_at,
        heads,
    } = fmt.pieces();
    let (singles, scales) = (groups * g, fmt.panel_scales_at());
    let slot = move |j: usize| {
        if fmt == QuantFormat::Q6_K {
            q6_k_slot(j)
        } else {
            j
        }
    };
    let quants = (0..groups).map(move |j| (quants_at + 4 * j, slot(j) * g + 4 * c, 4));
    let singles = (0..bytes).map(move |i| (bytes_at + i, singles + PANEL * i + c, 1));
    let heads = (0..heads).map(move |h| (heads_at + 2 * h, scales + 2 * PANEL * h + 2 * c, 2));
    quants.chain(singles).chain(heads)
}

/// Where a Q6_K block's 4-byte group `j` (of its 192 bytes of `ql`, then
/// `qh`) sits among a panel block's groups: in the order the kernels read
/// them, for each half super-block n and each g of 8, the `ql` group of
/// blocks 0 and 2 (bytes 64n + 4g), that of blocks 1 and 3 (64n + 32 + 4g)
/// and the `qh` group (32n + 4g), so that a panel streams from memory in
/// one direction.
pub(crate) fn q6_k_slot(j: usize) -> usize {
    let (n, g, which) = if j < 32 {
        (j / 16, j % 8, j % 16 / 8)
    } else {
        ((j - 32) / 8, (j - 32) % 8, 2)
    };
    3 * (8 * n + g) + which
}

/// Checks `w` holds N columns of `fmt` blocks for K inputs; returns N.
fn columns(w: &[u8], fmt: QuantFormat, k: usize) -> Result<usize, QuantShapeError> {
    let row_bytes = check_k(fmt, k)?;
    if !w.len().is_multiple_of(row_bytes) {
        return Err(QuantShapeError(format!(
            "{} bytes are not whole columns of {row_bytes}",
            w.len()
        )));
    }
    Ok(w.len() / row_bytes)
}

/// `rows` (a rows-layout weight, N columns of K inputs) in the panels
/// layout, written to `out` (the same size).
pub fn pack_blocks(
    rows: &[u8],
    fmt: QuantFormat,
    k: usize,
    out: &mut [u8],
) -> Result<(), QuantShapeError> {
    relayout(rows, fmt, k, out, true)
}

/// The inverse of `pack_blocks`.
pub fn unpack_blocks(
    panels: &[u8],
    fmt: QuantFormat,
    k: usize,
    out: &mut [u8],
) -> Result<(), QuantShapeError> {
    relayout(panels, fmt, k, out, false)
}

fn relayout(
    src: &[u8],
    fmt: QuantFormat,
    k: usize,
    out: &mut [u8],
    pack: bool,
) -> Result<(), QuantShapeError> {
    let n = columns(src, fmt, k)?;
    if out.len() != src.len() {
        return Err(QuantShapeError(format!(
            "output of {} bytes for {} bytes",
            out.len(),
            src.len()
        )));
    }
    let row_bytes = fmt.row_bytes(k);
    let whole = n / PANEL * PANEL;
    for p in 0..n / PANEL {
        let panel_at = p * PANEL * row_bytes;
        for_panel_pieces(fmt, k, p * PANEL, |r, to, len| {
            let q = panel_at + to;
            if pack {
                out[q..q + len].copy_from_slice(&src[r..r + len]);
            } else {
                out[r..r + len].copy_from_slice(&src[q..q + len]);
            }
        });
    }
    out[whole * row_bytes..].copy_from_slice(&src[whole * row_bytes..]);
    Ok(())
}

/// Calls `copy` with every piece of the panel of columns `col..col + 16`:
/// (offset in the rows-layout weight, offset in the packed panel, length).
#[inline(always)]
fn for_panel_pieces(
    fmt: QuantFormat,
    k: usize,
    col: usize,
    mut copy: impl FnMut(usize, usize, usize),
) {
    let (row_bytes, block_bytes) = (fmt.row_bytes(k), fmt.block_bytes());
    for b in 0..k / fmt.block_values() {
        for c in 0..PANEL {
            let row_at = (col + c) * row_bytes + b * block_bytes;
            let panel_at = b * fmt.panel_block_bytes();
            for (from, to, len) in pieces(fmt, c) {
                copy(row_at + from, panel_at + to, len);
            }
        }
    }
}

/// Columns `col..col + 16` of a rows-layout weight as one packed panel
/// (`K / block values` panel blocks), in plain code: what the AVX2
/// rearrangement (`quant_matmul_panel::pack_panel`) does for the 32-value
/// formats.
pub(crate) fn pack_panel_portable(
    w: &[u8],
    fmt: QuantFormat,
    k: usize,
    col: usize,
    out: &mut [u8],
) {
    for_panel_pieces(fmt, k, col, |from, to, len| {
        out[to..to + len].copy_from_slice(&w[from..from + len]);
    });
}

/// Column `col`'s block `b` of a weight in `layout`, in the rows layout
/// (`out`: one block's bytes).
pub(crate) fn column_block(
    w: &[u8],
    layout: BlockLayout,
    fmt: QuantFormat,
    k: usize,
    col: usize,
    b: usize,
    out: &mut [u8],
) {
    let (row_bytes, block_bytes) = (fmt.row_bytes(k), fmt.block_bytes());
    let n = w.len() / row_bytes;
    if layout == BlockLayout::Rows || col >= n / PANEL * PANEL {
        let at = col * row_bytes + b * block_bytes;
        out.copy_from_slice(&w[at..at + block_bytes]);
        return;
    }
    let panel_at = col / PANEL * PANEL * row_bytes + b * fmt.panel_block_bytes();
    for (from, to, len) in pieces(fmt, col % PANEL) {
        out[from..from + len].copy_from_slice(&w[panel_at + to..panel_at + to + len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u32) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                state as u8
            })
            .collect()
    }

    #[test]
    fn packing_is_a_permutation_and_unpacks_back() {
        for fmt in [
            QuantFormat::Q4_1,
            QuantFormat::Q8_0,
            QuantFormat::Q6_K,
            QuantFormat::Q4_K,
        ] {
            for (n, blocks) in [(1, 1), (16, 1), (17, 2), (40, 3), (48, 1)] {
                let k = blocks * fmt.block_values();
                let rows = bytes(n * fmt.row_bytes(k), (n * k) as u32);
                let mut panels = vec![0; rows.len()];
                pack_blocks(&rows, fmt, k, &mut panels).unwrap();
                let mut sorted = (rows.clone(), panels.clone());
                sorted.0.sort_unstable();
                sorted.1.sort_unstable();
                assert_eq!(sorted.0, sorted.1, "{fmt:?} n={n} k={k}");
                let mut back = vec![0; rows.len()];
                unpack_blocks(&panels, fmt, k, &mut back).unwrap();
                assert_eq!(back, rows, "{fmt:?} n={n} k={k}");
                let mut block = vec![0; fmt.block_bytes()];
                for col in 0..n {
                    for b in 0..blocks {
                        column_block(&panels, BlockLayout::Panels, fmt, k, col, b, &mut block);
                        let at = col * fmt.row_bytes(k) + b * fmt.block_bytes();
                        assert_eq!(block, rows[at..at + fmt.block_bytes()]);
                    }
                }
            }
        }
    }

    #[test]
    fn the_panel_order_is_the_documented_one() {
        // Column 3, block 1 of a q4_1 panel: its nibble bytes 8..12 in group
        // 2 at 4 * 3; its offset (bytes 2..4 of the block) after the scales.
        let (fmt, k) = (QuantFormat::Q4_1, 64);
        let rows = bytes(PANEL * fmt.row_bytes(k), 7);
        let mut panels = vec![0; rows.len()];
        pack_blocks(&rows, fmt, k, &mut panels).unwrap();
        let block = 3 * fmt.row_bytes(k) + fmt.block_bytes();
        let panel_block = fmt.panel_block_bytes();
        assert_eq!(
            panels[panel_block + 2 * 64 + 12..panel_block + 2 * 64 + 16],
            rows[block + 4 + 8..block + 4 + 12]
        );
        let offsets = panel_block + 256 + 32;
        assert_eq!(panels[offsets + 6..offsets + 8], rows[block + 2..block + 4]);
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut out = vec![0; 40];
        assert!(pack_blocks(&[0; 39], QuantFormat::Q4_1, 32, &mut out[..39]).is_err());
        assert!(pack_blocks(&[0; 40], QuantFormat::Q4_1, 32, &mut out[..20]).is_err());
        assert!(pack_blocks(&[0; 40], QuantFormat::Q4_1, 30, &mut out).is_err());
    }
}
