//! The instruction sets the kernels may use: what this CPU has, capped by
//! the `FERROX_CPU_ISA` environment variable (`portable`, `avx2`,
//! `avxvnni`, `avx512`, `amx`; unset: everything the CPU has). The cap lets
//! one machine run, test and measure the narrower kernels it would
//! otherwise never pick, as a CPU without AVX-512 runs them. Read once, at
//! the first kernel call.

use std::sync::OnceLock;

/// Instruction-set levels, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain code, whatever the CPU.
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-VNNI on top of AVX2: `vpdpbusd` on 256-bit registers (Intel's
    /// client cores from Alder Lake on, which have no AVX-512, and Sapphire
    /// Rapids and later Xeons).
    AvxVnni,
    /// AVX-512 (F, and BW / VNNI where a kernel names them) on top of AVX2.
    Avx512,
    /// AMX tiles (`quant_matmul_amx`, `paged_attention_amx`) on top of
    /// AVX-512.
    Amx,
}

impl Isa {
    /// The level a `FERROX_CPU_ISA` value names, or None if it names none.
    pub fn parse(value: &str) -> Option<Isa> {
        match value.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avxvnni" => Some(Isa::AvxVnni),
            "avx512" => Some(Isa::Avx512),
            "amx" | "native" | "" => Some(Isa::Amx),
            _ => None,
        }
    }
}

/// The cap set by `FERROX_CPU_ISA`; a value that names no level leaves the
/// CPU's own (the Python package refuses such a value before any kernel
/// runs).
pub fn cap() -> Isa {
    static CAP: OnceLock<Isa> = OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("FERROX_CPU_ISA")
            .ok()
            .and_then(|v| Isa::parse(&v))
            .unwrap_or(Isa::Amx)
    })
}

/// Whether kernels may use AVX2, FMA and F16C.
pub fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cap() >= Isa::Avx2
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether kernels may use AVX-VNNI (with AVX2, FMA and F16C).
pub fn avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cap() >= Isa::AvxVnni && avx2() && std::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether kernels may use AVX-512 F (with AVX2, FMA and F16C).
pub fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cap() >= Isa::Avx512 && avx2() && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether kernels may use AVX-512 BW and VNNI (with AVX-512 F).
pub fn avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512()
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The widest level kernels may use on this CPU under the cap.
pub fn effective() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if crate::quant_matmul_amx::supported() {
        return Isa::Amx;
    }
    if avx512() {
        Isa::Avx512
    } else if avx_vnni() {
        Isa::AvxVnni
    } else if avx2() {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}
