//! Structured outputs: a grammar's allowed next tokens, one bit per
//! vocabulary entry, applied to a batch of logits.

use std::fmt;

#[derive(Debug, PartialEq, Eq)]
pub struct BitmaskError(pub String);

impl fmt::Display for BitmaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "token bitmask: {}", self.0)
    }
}

impl std::error::Error for BitmaskError {}

/// Sets `logits[rows[g], t]` to -inf for every token `t` whose bit is 0 in
/// `bitmask[g]` (bit `t % 32` of word `t / 32`). `logits` is [R, vocab],
/// `bitmask` is [G, words] with `words * 32 >= vocab`. Words with every bit
/// set (free text) are skipped and words with none (a narrow grammar
/// state) filled whole.
pub fn apply_token_bitmask(
    logits: &mut [f32],
    vocab: usize,
    rows: &[i64],
    bitmask: &[i32],
    words: usize,
) -> Result<(), BitmaskError> {
    if vocab == 0 || !logits.len().is_multiple_of(vocab) {
        return Err(BitmaskError(format!(
            "{} logits are not whole rows of {vocab}",
            logits.len()
        )));
    }
    if words * 32 < vocab || bitmask.len() != rows.len() * words {
        return Err(BitmaskError(format!(
            "a bitmask of {} words for {} rows does not cover a vocabulary of {vocab}",
            bitmask.len(),
            rows.len()
        )));
    }
    let num_rows = logits.len() / vocab;
    for (g, &row) in rows.iter().enumerate() {
        let row = usize::try_from(row)
            .ok()
            .filter(|&r| r < num_rows)
            .ok_or_else(|| BitmaskError(format!("row {row} is outside [0, {num_rows})")))?;
        let out = &mut logits[row * vocab..(row + 1) * vocab];
        let mask = &bitmask[g * words..(g + 1) * words];
        for (w, &word) in mask.iter().enumerate() {
            if word == -1 {
                continue;
            }
            let start = (w * 32).min(vocab);
            let end = (start + 32).min(vocab);
            let span = &mut out[start..end];
            if word == 0 {
                span.fill(f32::NEG_INFINITY);
                continue;
            }
            // Branch-free, so that the compiler vectorises it.
            for (bit, value) in span.iter_mut().enumerate() {
                let keep = (word >> bit) & 1 != 0;
                *value = if keep { *value } else { f32::NEG_INFINITY };
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_only_the_cleared_bits_of_the_given_rows() {
        let vocab = 40;
        let mut logits: Vec<f32> = (0..3 * vocab).map(|i| i as f32).collect();
        // Row 2: tokens 1 and 33 allowed; row 0: all allowed.
        let bitmask = [0b10, 0b10, -1, -1];
        apply_token_bitmask(&mut logits, vocab, &[2, 0], &bitmask, 2).unwrap();
        for t in 0..vocab {
            assert_eq!(logits[t], t as f32);
            assert_eq!(logits[vocab + t], (vocab + t) as f32);
            let value = logits[2 * vocab + t];
            if t == 1 || t == 33 {
                assert_eq!(value, (2 * vocab + t) as f32);
            } else {
                assert_eq!(value, f32::NEG_INFINITY);
            }
        }
    }

    #[test]
    fn rejects_bad_shapes_and_rows() {
        let mut logits = vec![0.0; 64];
        assert!(apply_token_bitmask(&mut logits, 64, &[0], &[0], 1).is_err());
        assert!(apply_token_bitmask(&mut logits, 64, &[1], &[0, 0], 2).is_err());
        assert!(apply_token_bitmask(&mut logits, 64, &[-1], &[0, 0], 2).is_err());
        assert!(apply_token_bitmask(&mut logits, 30, &[0], &[0], 1).is_err());
    }
}
