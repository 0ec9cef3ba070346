"""Kernels for tables whose rows are stored in half precision (bfloat16 or float16).

The same functions and keywords as :mod:`distemb.kernels` (``gather_rows``,
``sgd_update``, ``adagrad_update``, ``rowwise_adagrad_update``, ``adam_update``,
``ftrl_update``), so an
update rule runs on half rows when handed this module as its ``ops``: gradients, optimizer
state and every operation stay float32; only the weight is stored in 16 bits, rounded
to nearest-even on each store (a half kernel equals decode, the float32 kernel, encode,
bit for bit). Lookups return float32 rows.

Weight arrays are ``numpy.float16`` for float16 and :data:`BFLOAT16` (a one-field
structured dtype over the uint16 bits, which numpy lacks; it refuses arithmetic, so bits
are never mistaken for integers) for bfloat16. Compiled code (``csrc/_halfkernels.pyx``)
is used under the same switches as every kernel (``DISTEMB_NO_EXT``,
``kernels.implementation()``); :mod:`distemb.kernels.reference_half` is its twin. The
module conforms to :class:`~distemb.kernels.ops.KernelOps` (``dedup_sum`` is the float32
one: gradients are float32 whatever the rows).

Example:
    >>> import numpy as np
    >>> w = encode(np.array([[1.0, 2.0]], np.float32), "bfloat16")
    >>> sgd_update(w, np.array([0]), np.array([[1.0, 1.0]], np.float32), lr=0.5)
    >>> decode(w).tolist()
    [[0.5, 1.5]]
"""
import functools

import numpy as np

from distemb import kernels
from distemb.kernels import reference_half, rule_table

if kernels.HAS_EXT:
    from distemb import _halfkernels as _compiled  # built with _kernels, same switch
else:
    _compiled = None
_IMPLS = {"compiled": _compiled, "reference": reference_half}


def _impl():
    """The implementation :func:`distemb.kernels.implementation` selects now."""
    return _IMPLS[kernels.active()]

#: numpy dtype of bfloat16 storage: the uint16 bits under a field named 'bfloat16'.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
#: Storage dtype of each half-precision dtype name.
HALF_DTYPES = {"bfloat16": BFLOAT16, "float16": np.dtype(np.float16)}
_KIND = {"bfloat16": reference_half.BF16, "float16": reference_half.F16}


def dtype_name(array):
    """'bfloat16', 'float16' or numpy's name of ``array``'s dtype."""
    return _name_of(array.dtype)


@functools.lru_cache(maxsize=64)
def _name_of(dtype):
    # cached: comparing a dtype with BFLOAT16's structured one costs ~20 us
    return "bfloat16" if dtype == BFLOAT16 else dtype.name


def storage_dtype(name):
    """The numpy dtype that stores rows of dtype ``name`` ('float32', 'bfloat16', ...)."""
    if name in HALF_DTYPES:
        return HALF_DTYPES[name]
    return np.dtype(name)


def is_half(name):
    """True for the half-precision row dtypes 'bfloat16' and 'float16'."""
    return name in HALF_DTYPES


def row_dtype(name):
    """The dtype rows of a table of dtype ``name`` are read and written in: float32 for
    half tables (16 bits are how they are stored and sent, not how they are computed)."""
    return "float32" if name in HALF_DTYPES else name


def as_rows(array):
    """``array`` as float32 rows when it holds half-precision rows (a new array), else
    ``array`` itself."""
    return decode(array) if dtype_name(array) in HALF_DTYPES else array


def shard_seed(seed, part):
    """The stochastic-rounding seed of partition ``part`` of a table seeded ``seed``:
    shards draw from disjoint seed ranges (each update call takes the next seed)."""
    return (int(seed) * 0x9E3779B1 + (int(part) << 32)) % (1 << 63)


def _bits(name, a, ndim=2):
    """(kind, uint16 view) of a half weight array; TypeError for anything else."""
    if not isinstance(a, np.ndarray) or dtype_name(a) not in _KIND or a.ndim != ndim \
            or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous bfloat16 ({BFLOAT16}) or float16 "
                        f"array of {ndim} dims, got {getattr(a, 'dtype', type(a).__name__)} "
                        f"ndim={getattr(a, 'ndim', None)}")
    return _KIND[dtype_name(a)], a.view(np.uint16)


def encode(values, name):
    """``values`` (float32) as a new half array of dtype ``name``, rounded to nearest-even."""
    if name not in _KIND:
        raise ValueError(f"name: expected one of {sorted(_KIND)}, got {name!r}")
    src = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(src.shape, HALF_DTYPES[name])
    _impl().encode(_KIND[name], src.reshape(-1), out.view(np.uint16).reshape(-1))
    return out


def decode(array):
    """A half array's values as a new float32 array."""
    kind, bits = _bits("array", array, array.ndim)
    out = np.empty(array.shape, np.float32)
    _impl().decode(kind, np.ascontiguousarray(bits).reshape(-1), out.reshape(-1))
    return out


def _ids(a):
    a = np.asarray(a)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise TypeError(f"rows: expected a 1-d integer array, got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _f32(name, a, shape):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape \
            or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array of shape {shape}, "
                        f"got {getattr(a, 'dtype', type(a).__name__)} "
                        f"{getattr(a, 'shape', None)}")
    return a


def _check(weight, rows, grads, seed):
    kind, bits = _bits("weight", weight)
    if seed is not None:
        if kind != reference_half.BF16:
            raise ValueError(f"rounding_seed: stochastic rounding is for bfloat16 rows, "
                             f"got {dtype_name(weight)} rows")
        kind = reference_half.BF16_SR
    rows = _ids(rows)
    grads = _f32("grads", np.ascontiguousarray(grads), (rows.shape[0], weight.shape[1]))
    return kind, bits, rows, grads, int(seed or 0) & (2 ** 64 - 1)


def _nt(num_threads, grads):
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) \
            or num_threads < 1:
        raise ValueError(f"num_threads: expected a positive int, got {num_threads!r}")
    # as distemb.kernels: below this much work per thread, extra threads only cost a wake-up
    return int(max(1, min(num_threads, grads.size // kernels.MIN_FLOATS_PER_THREAD)))


def dedup_sum(ids, grads, num_rows=None, out=None, num_threads=1):
    """:func:`distemb.kernels.dedup_sum` (gradients are float32 whatever the rows)."""
    return kernels.dedup_sum(ids, grads, num_rows=num_rows, out=out, num_threads=num_threads)


def gather_rows(table, rows, out=None, num_threads=1):
    """``table[rows]`` as float32 rows into ``out`` (allocated when None); see kernels."""
    kind, bits = _bits("table", table)
    rows = _ids(rows)
    if out is None:
        out = np.empty((rows.shape[0], table.shape[1]), np.float32)
    elif out.shape != (rows.shape[0], table.shape[1]) or out.dtype != np.float32 \
            or not out.flags.c_contiguous:
        raise ValueError(f"out: expected a C-contiguous float32 array of shape "
                         f"{(rows.shape[0], table.shape[1])}, got {out.dtype} {out.shape}")
    _impl().gather_rows(kind, bits, rows, out, num_threads=_nt(num_threads, out))
    return out


def rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1):
    """In place, row-wise Adagrad (one float32 accumulator per row), to nearest-even."""
    seeded_rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads)


def adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, num_threads=1):
    """In place, SparseAdam with float32 moments and half rows, to nearest-even."""
    seeded_adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                       row_steps, num_threads)


# The same updates with a choice of rounding: ``rounding_seed`` None rounds to
# nearest-even; an int rounds bfloat16 rows stochastically with random bits hashed from
# (seed, row, column), reproducible for any thread count (use a new seed per call).


def seeded_rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads=1,
                                  rounding_seed=None):
    """In place, row-wise Adagrad with one float32 accumulator per row and half rows."""
    kind, bits, rows, grads, seed = _check(weight, rows, grads, rounding_seed)
    _f32("state_sum", state_sum, weight.shape[:1])
    _impl().rowwise_adagrad_update(kind, bits, state_sum, rows, grads, float(clr), float(eps),
                                 seed=seed, num_threads=_nt(num_threads, grads))


def seeded_adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                       step, row_steps=None, num_threads=1, rounding_seed=None):
    """In place, SparseAdam with float32 moments and half rows (see kernels.adam_update)."""
    kind, bits, rows, grads, seed = _check(weight, rows, grads, rounding_seed)
    _f32("exp_avg", exp_avg, weight.shape)
    _f32("exp_avg_sq", exp_avg_sq, weight.shape)
    if row_steps is not None and (row_steps.dtype != np.int64
                                  or row_steps.shape != weight.shape[:1]):
        raise TypeError(f"row_steps: expected int64 of shape {weight.shape[:1]}, got "
                        f"{row_steps.dtype} {row_steps.shape}")
    _impl().adam_update(kind, bits, exp_avg, exp_avg_sq, rows, grads, float(lr), float(beta1),
                        float(beta2), float(eps), int(step), row_steps=row_steps, seed=seed,
                        num_threads=_nt(num_threads, grads))


class StochasticRounding:
    """The half kernels with stochastic rounding of bfloat16 rows, as an ``ops`` for rules.

    Each update call uses the next seed of a counter started at ``seed``, so a training
    run is reproducible (same seed, same calls, any thread count) and no two calls share
    random bits. Lookups and float16 rows are unaffected by rounding (float16: rejected).

    Args:
        seed: the first call's seed.

    Example:
        >>> ops = StochasticRounding(seed=1)
        >>> w = encode(np.ones((1, 4), np.float32), "bfloat16")
        >>> for _ in range(100):  # each step is 1/10 of an ulp: nearest-even keeps 1.0
        ...     ops.sgd_update(w, np.array([0]), np.full((1, 4), -2 ** -10, np.float32), 1.0)
        >>> bool(decode(w).mean() > 1.05)
        True
    """

    def __init__(self, seed=0):
        self._next = int(seed)

    def _seed(self):
        self._next += 1
        return self._next - 1

    dedup_sum = staticmethod(dedup_sum)
    gather_rows = staticmethod(gather_rows)

    def rowwise_adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        seeded_rowwise_adagrad_update(weight, state_sum, rows, grads, clr, eps, num_threads,
                                      rounding_seed=self._seed())

    def adam_update(self, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                    step, row_steps=None, num_threads=1):
        seeded_adam_update(weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                           step, row_steps, num_threads, rounding_seed=self._seed())


def _elementwise(rule):
    """The half kernels of an element-wise rule, made from its table entry: the seeded
    update, the nearest-even one and :class:`StochasticRounding`'s method."""
    states = "".join(f"{s}, " for s in rule.states)
    hyper = ", ".join(rule.hyper_names)
    seeded = "seeded_" + rule.kernel
    source = (
        f"def {seeded}({rule.params()}, rounding_seed=None):\n"
        "    kind, bits, rows, grads, seed = _check(weight, rows, grads, rounding_seed)\n"
        + "".join(f"    _f32({s!r}, {s}, weight.shape)\n" for s in rule.states)
        + rule_table.checks(rule)
        + f"    _impl().{rule.kernel}(kind, bits, {states}rows, grads, {rule_table.floats(rule)},\n"
          "        seed=seed, num_threads=_nt(num_threads, grads))\n")
    names = ", ".join(rule.states) or "none"
    doc = (f"In place on half rows: {rule.summary}\n\nThe states ({names}) are float32 "
           "(R, D); ``rounding_seed`` None rounds to nearest-even, an int rounds bfloat16 "
           "rows stochastically (see the module docstring).")
    globals()[seeded] = rule_table.define(source, globals(), seeded, doc)
    call = f"{seeded}(weight, {states}rows, grads, {hyper}, num_threads"
    globals()[rule.kernel] = rule_table.define(
        f"def {rule.kernel}({rule.params()}):\n    {call})\n", globals(), rule.kernel,
        f"In place on half rows, rounded to nearest-even: {rule.summary}")
    setattr(StochasticRounding, rule.kernel, rule_table.define(
        f"def {rule.kernel}(self, {rule.params()}):\n"
        f"    {call}, rounding_seed=self._seed())\n", globals(), rule.kernel,
        f"{rule.kernel} with the next seed's stochastic rounding."))


# sgd_update, adagrad_update, ftrl_update and their seeded_* twins, ...: per table rule.
for _rule in rule_table.RULES:
    _elementwise(_rule)
del _rule
