"""Exception types. Every error distemb raises on bad input derives from DistEmbError."""


class DistEmbError(Exception):
    """Base class of distemb's errors."""


class ConfigError(DistEmbError, ValueError):
    """A config file or object is invalid; the message starts with the field path."""


class PartitionError(DistEmbError, ValueError):
    """Ids, partition books or policies that do not fit together."""


class BackendError(DistEmbError):
    """A backend is unknown, or lacks a function of the F.* contract."""


class KVStoreError(DistEmbError):
    """A key-value store request failed (unknown name, shape mismatch, server error)."""


class TraceOverflowError(DistEmbError):
    """An embedding's gradient trace grew past its bound: step()/zero_grad() was never called."""
