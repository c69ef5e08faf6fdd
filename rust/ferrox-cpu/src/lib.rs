//! CPU kernels for the ferrox model runner. Pure Rust on plain slices; the
//! Python bindings hand in numpy views of torch tensors.

pub mod paged_attention;

pub use paged_attention::{paged_attention, PagedAttentionArgs};
