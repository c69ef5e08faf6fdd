//! Block-format weights the kernel benches share.

use ferrox_cpu::QuantFormat;

/// Pseudo-random bytes of valid blocks: small positive float16 scales,
/// any nibbles / signed bytes in -127..=127.
pub fn weights(fmt: QuantFormat, n: usize, k: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    let scale = 0x2000u16.to_le_bytes(); // 2^-7
    let mut out = Vec::with_capacity(n * fmt.row_bytes(k));
    if fmt == QuantFormat::Q6_K {
        for _ in 0..n * k / 256 {
            out.extend((0..208).map(|_| next() as u8)); // 6-bit values, scales
            out.extend(scale);
        }
        return out;
    }
    if fmt == QuantFormat::Q4_K {
        for _ in 0..n * k / 256 {
            out.extend(scale); // d
            out.extend(scale); // dmin
            out.extend((0..140).map(|_| next() as u8)); // 6-bit scales and mins, nibbles
        }
        return out;
    }
    for _ in 0..n * k / 32 {
        out.extend(scale);
        match fmt {
            QuantFormat::Q4_1 => {
                out.extend(0xa000u16.to_le_bytes()); // offset -2^-7 * 2
                out.extend((0..16).map(|_| next() as u8));
            }
            QuantFormat::Q8_0 => {
                out.extend((0..32).map(|_| ((next() % 255) as i16 - 127) as i8 as u8))
            }
            QuantFormat::Q6_K | QuantFormat::Q4_K => unreachable!(),
        }
    }
    out
}
