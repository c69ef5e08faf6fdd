//! The element types a KV cache may hold: float32, or float16 (half the
//! memory and half the bytes attention reads; converted to float32 as the
//! kernels load it, as llama.cpp's default cache does).

use crate::quant_matmul::f16_to_f32;

pub trait KvElement: Copy + Send + Sync + 'static {
    /// Whether the vector loops load it as float16 (else as float32).
    const HALF: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl KvElement for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// An IEEE float16, as its bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

impl KvElement for F16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F16(f32_to_f16(x))
    }
}

/// float32 to float16 bits, rounded to nearest (ties to even); beyond
/// float16's range to infinity, NaN stays NaN.
pub fn f32_to_f16(value: f32) -> u16 {
    let x = value.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x7f_ffff;
    if exp == 0xff {
        let nan = if man != 0 {
            0x200 | (man >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // A float16 subnormal (or zero): units of 2^-24.
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rounded = (m + half - 1 + ((m >> shift) & 1)) >> shift;
        return sign | rounded as u16;
    }
    let kept = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    // A carry out of the mantissa rounds up into the exponent (to infinity
    // past the largest finite value): what round-to-nearest asks.
    let rounded = if rest > 0x1000 || (rest == 0x1000 && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    };
    sign | rounded as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float16_round_trips() {
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_nan() {
                assert!(f16_to_f32(f32_to_f16(x)).is_nan());
            } else {
                assert_eq!(f32_to_f16(x), bits, "{bits:#06x} ({x})");
            }
        }
    }

    #[test]
    fn floats_round_to_the_nearest_float16() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Magnitudes from float16's subnormals to past its largest value.
            let x =
                f32::from_bits((s as u32 & 0x807f_ffff) | ((((s >> 32) % 40) as u32 + 97) << 23));
            let h = f32_to_f16(x);
            let got = f16_to_f32(h) as f64;
            let err = (got - x as f64).abs();
            // No neighbour is closer (a tie keeps the even one).
            for n in [h.wrapping_sub(1), h.wrapping_add(1)] {
                let other = f16_to_f32(n);
                if other.is_finite() && (other.is_sign_negative() == x.is_sign_negative()) {
                    let e = (other as f64 - x as f64).abs();
                    assert!(err < e || (err == e && h & 1 == 0), "{x}: {got} vs {other}");
                }
            }
        }
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds past 65504: infinity
        assert_eq!(f32_to_f16(-1e-9), 0x8000);
    }
}
