"""Exception types. Every error distemb raises on bad input derives from DistEmbError.

Example:
    >>> try:
    ...     raise PartitionError("ids: id 9 is out of range")
    ... except DistEmbError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    PartitionError True
"""


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


class NonFiniteGradientError(DistEmbError, ValueError):
    """A step's gradients hold NaN or infinity: the step is refused before any row or
    optimizer state changes (on every trainer of a collective job); its gradients are
    dropped."""


class TraceOverflowError(DistEmbError):
    """An embedding's gradient trace grew past its bound: step()/zero_grad() was never called."""


class TransportError(KVStoreError):
    """A message could not be sent or received, or a frame on the wire is malformed."""


class ServerUnavailableError(TransportError):
    """A KVStore server is dead, unreachable, or did not answer within the timeout."""


class StoreError(KVStoreError):
    """A row store cannot do what was asked (bad key, full or read-only disk, bad column)."""


class MissingKeyError(StoreError):
    """Keys read without insertion are not in a hash-keyed table (never added, or removed)."""
