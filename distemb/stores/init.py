"""Initial rows that are a pure function of the key: the same row in every run, on any
number of servers, in whatever order keys first arrive.

Each element is drawn from a counter-based generator: ``splitmix64(seed, key, column)``
gives 64 random bits, of which 24 make a uniform float32 in [0, 1) (normals: Box-Muller
on two of them). Vectorised numpy: about 20 ns per element.

Example:
    >>> import numpy as np
    >>> init = key_uniform(4, -0.1, 0.1, seed=7)
    >>> a = init(np.array([5, 10**15]))
    >>> b = init(np.array([10**15]))
    >>> bool((a[1] == b[0]).all()), a.dtype, bool((abs(a) <= 0.1).all())
    (True, dtype('float32'), True)
"""
import numpy as np

from distemb.kernels.hashtable import keys_array
from distemb.stores.types import check_dim

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x):
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key_bits(keys, width, seed=0, stream=0):
    """(N, width) uint64: 64 random bits per (key, column), a pure function of its inputs."""
    k = keys_array(keys).view(np.uint64)
    with np.errstate(over="ignore"):
        base = _splitmix(k ^ _splitmix(np.uint64(seed) * _GOLDEN + np.uint64(stream)))
        cols = np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN
        return _splitmix(base[:, None] + cols[None, :])


def _unit(bits):
    """Uniform float32 in [0, 1) from the top 24 bits."""
    return (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def key_uniform(dim, low=-1.0, high=1.0, seed=0):
    """``init(keys)``: rows uniform in [low, high), deterministic per key and seed."""
    dim = check_dim(dim)
    if not low < high:
        raise ValueError(f"low, high: expected low < high, got {low!r}, {high!r}")
    lo, span = np.float32(low), np.float32(high - low)

    def init(keys):
        return lo + span * _unit(key_bits(keys, dim, seed))

    return init


def key_normal(dim, std=1.0, seed=0):
    """``init(keys)``: rows normal(0, std), deterministic per key and seed."""
    dim = check_dim(dim)
    if not std > 0:
        raise ValueError(f"std: expected a positive float, got {std!r}")

    def init(keys):
        u1 = 1.0 - _unit(key_bits(keys, dim, seed, stream=1)).astype(np.float64)  # (0, 1]
        u2 = _unit(key_bits(keys, dim, seed, stream=2)).astype(np.float64)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return (std * z).astype(np.float32)

    return init
