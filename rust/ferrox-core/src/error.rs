//! Typed errors of the core. Every fallible call returns `Result<T, CoreError>`
//! and leaves the state unchanged when it fails.

use std::fmt;

pub type Result<T> = std::result::Result<T, CoreError>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// An argument is out of range or malformed (bad config, mismatched lengths, ...).
    InvalidArgument(String),
    /// The pool has fewer free blocks than requested.
    OutOfBlocks { requested: usize, available: usize },
    /// A block id outside `[0, num_blocks)`.
    BlockOutOfRange { block: u32, num_blocks: usize },
    /// Releasing a block that holds no reference.
    BlockNotAllocated { block: u32 },
    /// A radix-cache handle that does not name a live node.
    InvalidHandle { handle: u64 },
    /// Unlocking a node that holds no lock.
    NotLocked { handle: u64 },
    /// A request id already in use.
    DuplicateRequest { id: u64 },
    /// A request that the scheduler must refuse (empty prompt, too long, ...).
    RequestRejected { id: u64, reason: String },
    /// A stale or foreign batch plan handed to `update`.
    PlanMismatch(String),
    /// An invariant does not hold (a bug, reported by `check_integrity`).
    Integrity(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidArgument(msg) => write!(f, "{msg}"),
            CoreError::OutOfBlocks {
                requested,
                available,
            } => write!(
                f,
                "out of KV blocks: requested {requested}, only {available} free"
            ),
            CoreError::BlockOutOfRange { block, num_blocks } => write!(
                f,
                "block id {block} is out of range: the pool has {num_blocks} blocks"
            ),
            CoreError::BlockNotAllocated { block } => {
                write!(f, "block {block} is not allocated (double free?)")
            }
            CoreError::InvalidHandle { handle } => {
                write!(f, "radix cache handle {handle} does not name a live node")
            }
            CoreError::NotLocked { handle } => {
                write!(f, "radix cache node {handle} is not locked")
            }
            CoreError::DuplicateRequest { id } => write!(f, "request id {id} is already in use"),
            CoreError::RequestRejected { id, reason } => {
                write!(f, "request {id} rejected: {reason}")
            }
            CoreError::PlanMismatch(msg) => write!(f, "batch plan mismatch: {msg}"),
            CoreError::Integrity(msg) => write!(f, "integrity check failed: {msg}"),
        }
    }
}

impl std::error::Error for CoreError {}

/// Returns `Err(CoreError::Integrity)` with a formatted message when `cond` is false.
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err($crate::error::CoreError::Integrity(format!($($arg)+)));
        }
    };
}
pub(crate) use ensure;
