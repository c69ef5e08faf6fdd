//! CPU kernels for the ferrox model runner. Pure Rust on plain slices; the
//! Python bindings hand in numpy views of torch tensors.

pub mod elementwise;
pub mod paged_attention;
pub mod token_bitmask;

pub use elementwise::{add_rms_norm, rotary_in_place};
pub use paged_attention::{paged_attention, PagedAttentionArgs, ShapeError};
pub use token_bitmask::{apply_token_bitmask, BitmaskError};
