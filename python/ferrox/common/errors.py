"""Typed exceptions raised by ferrox.

Bad arguments raise subclasses of `ValueError`; states the engine cannot serve
(an exhausted KV pool, a broken invariant) raise subclasses of `RuntimeError`.
The native core raises these same classes.
"""


class FerroxError(Exception):
    """Base class of every error ferrox raises on purpose."""


class InvalidArgumentError(FerroxError, ValueError):
    """An argument or request field is out of range or malformed."""


class InvalidBlockError(InvalidArgumentError):
    """A KV block id outside the pool."""


class BlockNotAllocatedError(InvalidArgumentError):
    """Releasing a KV block that holds no reference (a double free)."""


class InvalidHandleError(InvalidArgumentError):
    """A prefix-cache handle that names no live node."""


class NotLockedError(InvalidArgumentError):
    """Unlocking a prefix-cache node that is not locked."""


class RequestRejectedError(InvalidArgumentError):
    """The scheduler refused a request (empty, too long, out of vocabulary...)."""


class DuplicateRequestError(RequestRejectedError):
    """A request id that is already in use."""


class ContextLengthExceededError(RequestRejectedError):
    """The prompt (plus the requested output) does not fit the context window."""


class LoRAAdapterError(InvalidArgumentError):
    """A LoRA adapter that cannot be served: missing files, a malformed
    config, a rank over the limit, modules or shapes the model lacks."""


class UnsupportedModelError(FerroxError, ValueError):
    """The model's architecture, tensor layout or tokenizer is not supported."""


class MissingDependencyError(FerroxError, RuntimeError):
    """An optional package a command needs is not installed; the message names the extra."""


class ModelLoadError(FerroxError, RuntimeError):
    """A model file could not be found, fetched, verified or read."""


class OutOfBlocksError(FerroxError, RuntimeError):
    """The KV pool has fewer free blocks than requested."""


class SchedulerStateError(FerroxError, RuntimeError):
    """A call out of order, such as updating a plan that is not outstanding."""


class IntegrityError(FerroxError, RuntimeError):
    """An internal invariant does not hold (a bug in ferrox)."""


class RequestFailedError(FerroxError, RuntimeError):
    """An unexpected error in an engine step this request was part of; the
    request was ended, and the engine serves the others."""


class ServerBusyError(FerroxError, RuntimeError):
    """The server is draining or its queues are full: retry later (HTTP 503
    with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(FerroxError, RuntimeError):
    """The request ran past its time limit and was aborted."""


class EngineDeadError(FerroxError, RuntimeError):
    """The engine process stopped; no further requests can be served."""


def error_class(name: str) -> type[FerroxError]:
    """The error class of that name (as the engine process reports a failed
    request), so that each failure keeps its kind across the process hop;
    `InvalidArgumentError` for a name that is not one."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, FerroxError):
        return cls
    return InvalidArgumentError
