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


class KeyInit:
    """A key-deterministic initialiser: ``init(keys) -> (len(keys), dim) float32``.

    Besides being called, it describes itself as a *spec* (:meth:`spec`: a kind name and
    plain numbers) that :func:`init_from_spec` turns back into the same initialiser: the
    form in which a cluster's servers are told how to make a new key's row (no Python
    function crosses the wire).

    Example:
        >>> init = key_normal(4, std=0.5, seed=3)
        >>> init.spec()
        ('normal', {'dim': 4, 'std': 0.5, 'seed': 3})
        >>> again = init_from_spec(*init.spec())
        >>> bool((again(np.array([9])) == init(np.array([9]))).all())
        True
    """

    kind = ""

    def __init__(self, dim, **params):
        self.dim = check_dim(dim)
        self.params = params

    def spec(self):
        """``(kind, {"dim": ..., parameter: number})``: what :func:`init_from_spec` takes."""
        return self.kind, {"dim": self.dim, **self.params}

    def __call__(self, keys):
        raise NotImplementedError  # pragma: no cover (subclasses define it)

    def __eq__(self, other):
        return isinstance(other, KeyInit) and self.spec() == other.spec()

    def __hash__(self):
        return hash((self.kind, tuple(sorted(self.spec()[1].items()))))

    def __repr__(self):
        kind, params = self.spec()
        return f"key_{kind}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


def _seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
            not 0 <= seed < 1 << 63:
        raise ValueError(f"seed: expected an int in [0, 2**63), got {seed!r}")
    return int(seed)


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating,
                                                         np.integer)) or \
            not np.isfinite(value):
        raise ValueError(f"{what}: expected a finite number, got {value!r}")
    return float(value)


class KeyUniform(KeyInit):
    """Rows uniform in [low, high), deterministic per key and seed (see :func:`key_uniform`)."""

    kind = "uniform"

    def __init__(self, dim, low=-1.0, high=1.0, seed=0):
        low, high = _number(low, "low"), _number(high, "high")
        if not low < high:
            raise ValueError(f"low, high: expected low < high, got {low!r}, {high!r}")
        super().__init__(dim, low=low, high=high, seed=_seed(seed))
        self._lo, self._span = np.float32(low), np.float32(high - low)

    def __call__(self, keys):
        return self._lo + self._span * _unit(key_bits(keys, self.dim, self.params["seed"]))


class KeyNormal(KeyInit):
    """Rows normal(0, std), deterministic per key and seed (see :func:`key_normal`)."""

    kind = "normal"

    def __init__(self, dim, std=1.0, seed=0):
        std = _number(std, "std")
        if not std > 0:
            raise ValueError(f"std: expected a positive float, got {std!r}")
        super().__init__(dim, std=std, seed=_seed(seed))

    def __call__(self, keys):
        seed = self.params["seed"]
        u1 = 1.0 - _unit(key_bits(keys, self.dim, seed, stream=1)).astype(np.float64)  # (0, 1]
        u2 = _unit(key_bits(keys, self.dim, seed, stream=2)).astype(np.float64)
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return (self.params["std"] * z).astype(np.float32)


class KeyZeros(KeyInit):
    """Rows of zeros (what a dynamic table without ``init_func`` gives a new key)."""

    kind = "zeros"

    def __call__(self, keys):
        return np.zeros((len(keys_array(keys)), self.dim), np.float32)


INITS = {c.kind: c for c in (KeyUniform, KeyNormal, KeyZeros)}


def key_uniform(dim, low=-1.0, high=1.0, seed=0):
    """``init(keys)``: rows uniform in [low, high), deterministic per key and seed.

    Returns:
        a :class:`KeyUniform` (callable, and describable as a spec for servers).
    """
    return KeyUniform(dim, low, high, seed)


def key_normal(dim, std=1.0, seed=0):
    """``init(keys)``: rows normal(0, std), deterministic per key and seed.

    Returns:
        a :class:`KeyNormal` (callable, and describable as a spec for servers).
    """
    return KeyNormal(dim, std, seed)


def init_from_spec(kind, params):
    """The initialiser a :meth:`KeyInit.spec` describes (e.g. as received by a server).

    Raises:
        ValueError: an unknown ``kind``, or parameters it does not take or accept.
    """
    cls = INITS.get(kind)
    if cls is None:
        raise ValueError(f"init: expected one of {sorted(INITS)}, got {kind!r}")
    if not isinstance(params, dict):
        raise ValueError(f"init parameters: expected a dict, got {type(params).__name__}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"init parameters of {kind!r}: {e} (got {sorted(params)})") from None


class ShardInit:
    """A table's initialiser of whole partitions, ``init(shape, dtype) -> rows`` (DGL's
    ``init_func``): called once per partition of a fixed-key table with that partition's
    shape, where the function lives (the client that makes the table writes the rows; a
    Python function does not travel to servers).

    Example:
        >>> init = ShardInit(lambda shape, dtype: np.ones(shape, dtype))
        >>> init((2, 3), "float32").sum()
        6.0
    """

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, shape, dtype):
        return self.fn(shape, dtype)

    def __eq__(self, other):
        return isinstance(other, ShardInit) and other.fn is self.fn

    def __hash__(self):
        return hash(id(self.fn))

    def __repr__(self):
        return f"ShardInit({getattr(self.fn, '__qualname__', self.fn)!r})"


class ShardKeys:
    """A key initialiser seen from one shard: its store key ``k`` is the table's key
    ``router.to_global(part, k)``, whose row it gets (so a key's row does not depend on
    the shard holding it)."""

    def __init__(self, init, router, part):
        self.init, self.router, self.part = init, router, part

    def __call__(self, keys):
        return self.init(self.router.to_global(self.part, keys))


def init_fields(init, dim):
    """(kind, params) of a key initialiser (None: zeros) a server can rebuild, for a
    table spec's fields; TypeError for anything else (a Python function)."""
    init = init if init is not None else KeyZeros(dim)
    if not isinstance(init, KeyInit):
        raise TypeError(
            f"init_func: a table on a cluster's servers needs an initialiser its servers "
            f"can rebuild: distemb.stores.key_normal(dim, std, seed) or key_uniform(dim, "
            f"low, high, seed) (or None for zeros), got {init!r}; a Python function "
            f"cannot be sent to the servers")
    return init.spec()


def init_of_fields(fields):
    """The initialiser a table spec's fields describe (None for zeros).

    Raises:
        ValueError: an unknown ``init`` or bad ``init_args``, or ``init_args.dim`` other
            than the spec's ``dim`` (zeros of another dim too: a spec says nothing it
            does not mean).
    """
    init = init_from_spec(fields["init"], dict(fields["init_args"]))
    if init.dim != fields["dim"]:
        raise ValueError(f"init_args.dim: {init.dim}, the table's dim is {fields['dim']!r} "
                         "(the initialiser makes the table's rows)")
    return None if isinstance(init, KeyZeros) else init
