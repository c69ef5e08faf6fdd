//! ferrox-core: the host-side brain of the ferrox inference engine — the
//! paged-KV block allocator, the radix prefix cache and the request
//! scheduler. Pure Rust; the Python bindings live in `ferrox-py`.

pub mod block_allocator;
pub mod error;
pub mod radix_cache;

pub use block_allocator::{BlockAllocator, BlockId, NULL_BLOCK};
pub use error::{CoreError, Result};
pub use radix_cache::{
    usable_window_prefix, InsertOutcome, Namespace, NodeHandle, PrefixMatch, RadixCache,
    SnapshotId, SnapshotMatch,
};
pub mod config;
pub mod plan;
mod plan_builder;
pub mod request;
pub mod scheduler;
mod scheduler_blocks;
mod scheduler_integrity;
mod scheduler_snapshots;
mod scheduler_update;
pub mod speculation;

pub use config::{Policy, SchedulerConfig, SpecConfig, SpecMethod, MAX_SPECULATIVE_TOKENS};
pub use plan::{BatchPlan, SchedulerStats, StepEvents};
pub use request::{FinishReason, Request, RequestParams, RequestStatus};
pub use scheduler::Scheduler;
pub use speculation::{SpecCost, SpecStats};
