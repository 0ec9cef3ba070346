"""The one module that imports compiled kernels, with a reference twin for each.

The functions here follow the contract of :mod:`distemb.kernels.ops` (signatures, shapes,
dtypes): they validate dtypes and layout once and then trust the implementation; ids must
already be range-checked by the caller. ``HAS_EXT`` says whether the compiled module
(``distemb._kernels``, built from ``csrc/_kernels.pyx`` with OpenMP) loaded.

Choosing the implementation, in one place:

- ``DISTEMB_NO_EXT=1`` in the environment forces the numpy twins
  (:mod:`distemb.kernels.reference`) for the whole process and its children (CI reruns
  the whole suite so);
- ``with kernels.implementation("reference"):`` (or ``"compiled"``) switches this process
  for the duration of the block (tests parametrise over it; see tests/conftest.py).

Every compiled CPU kernel (the updates on float32 and half rows, the gathers, dedup's sort
and sums) exists in three builds, picked at import: baseline x86-64, AVX2 + FMA + F16C,
and AVX-512 (F/BW/VL), the best this CPU runs. All give the same bits (no FMA
contraction in any; see csrc/cpu_kernels.h). :data:`ISA` names the build in use;
``DISTEMB_CPU_ISA`` (``baseline``, ``avx2``, ``avx512`` or ``best``, the default) picks
one for the whole process (a build this CPU lacks is refused at import, with the reason);
``with kernels.cpu_isa("baseline"):`` for a block (the tests run the kernel and optimizer
oracles under each build this CPU has).

Output buffers: ``gather_rows(out=...)`` and ``dedup_sum(out=...)`` write into a buffer
the caller owns and reuses, which avoids a fresh allocation per step. Reuse is only safe
where nobody keeps the previous result: a client's coalescing owns its dedup buffer
(``push_update`` consumes the sums before returning), whereas a ``DistEmbedding`` lookup
always gets fresh rows, because the user and the trace keep them past the next lookup.

Example:
    >>> import numpy as np
    >>> from distemb import kernels
    >>> ids = np.array([3, 1, 3], dtype=np.int64)
    >>> g = np.ones((3, 2), dtype=np.float32)
    >>> kernels.dedup_sum(ids, g)[0]
    array([1, 3])
    >>> with kernels.implementation("reference"):
    ...     kernels.active()
    'reference'
"""
import contextlib
import os
from typing import Iterator, Optional, Tuple

import numpy as np

from distemb.arrays import Array, GlobalIds, Rows, UniqueIds
from distemb.kernels import reference, rule_table

if os.environ.get("DISTEMB_NO_EXT", "") not in ("", "0"):
    _compiled = _compiled_half = None
else:
    try:
        from distemb import _halfkernels as _compiled_half
        from distemb import _kernels as _compiled
    except ImportError:  # not built (e.g. running from a bare checkout)
        _compiled = _compiled_half = None
    else:
        for _module in (_compiled, _compiled_half):
            if not hasattr(_module, "isa_supported"):  # built from older sources
                where = getattr(_module, "__file__", "?")
                raise ImportError(
                    f"{_module.__name__} ({where}) was built from older sources (it has "
                    "no isa_supported): rebuild it, e.g. `python setup.py build_ext "
                    "--inplace` or `make`")

HAS_EXT = _compiled is not None
IMPL_NAME = "compiled" if HAS_EXT else "reference"
_IMPLS = {"reference": reference, "compiled": _compiled}
# The implementation in use. Changed only by implementation(), which restores it.
_impl = _compiled if HAS_EXT else reference


#: The compiled builds by name (``set_isa``'s number in each extension module).
CPU_ISAS = {"best": -1, "baseline": 0, "avx2": 1, "avx512": 2}
#: Every build's name, best last (whether or not this CPU runs it).
ALL_CPU_ISAS = ("baseline", "avx2", "avx512")


def available_cpu_isas() -> Tuple[str, ...]:
    """The builds of the compiled kernels this CPU runs, best last, e.g.
    ``('baseline', 'avx2', 'avx512')``; ``()`` when the compiled kernels are not loaded."""
    if not HAS_EXT:
        return ()
    return tuple(name for name in ALL_CPU_ISAS if _compiled.isa_supported(CPU_ISAS[name]))


def _set_cpu_isa(name: str) -> None:
    global ISA
    if name not in CPU_ISAS:
        raise ValueError(f"isa: expected one of {sorted(CPU_ISAS)}, got {name!r}")
    if name != "best" and name not in available_cpu_isas():
        raise ValueError(f"isa: {name!r} is not available here (this CPU runs "
                         f"{available_cpu_isas()}, compiled kernels loaded: {HAS_EXT})")
    if HAS_EXT:
        _compiled.set_isa(CPU_ISAS[name])
        _compiled_half.set_isa(CPU_ISAS[name])
    ISA = current_cpu_isa()


def current_cpu_isa() -> str:
    """The build the compiled kernels run now: 'baseline', 'avx2' or 'avx512' ('' when
    the compiled kernels are not loaded)."""
    if not HAS_EXT:
        return ""
    isa = _compiled.get_isa()
    return ALL_CPU_ISAS[_compiled.best_isa() if isa < 0 else isa]


@contextlib.contextmanager
def cpu_isa(name: str) -> Iterator[None]:
    """Run the block's compiled kernels (float32 and half rows) on build ``name``
    (``'baseline'``, ``'avx2'``, ``'avx512'`` or ``'best'``), then restore the previous
    choice.

    Raises:
        ValueError: an unknown name, or a build this CPU (or this install) lacks.
    """
    global ISA
    saved, saved_name = (_compiled.get_isa() if HAS_EXT else -1), ISA
    _set_cpu_isa(name)
    try:
        yield
    finally:
        if HAS_EXT:
            _compiled.set_isa(saved)
            _compiled_half.set_isa(saved)
        ISA = saved_name


#: The build the compiled kernels run now ('baseline', 'avx2' or 'avx512'; '' when they
#: are not loaded): chosen at import (``DISTEMB_CPU_ISA``), changed by :func:`cpu_isa`.
ISA = ""
if HAS_EXT:
    _set_cpu_isa(os.environ.get("DISTEMB_CPU_ISA", "best") or "best")


def active() -> str:
    """'compiled' or 'reference': the implementation the functions here call now."""
    return "compiled" if _impl is _compiled and HAS_EXT else "reference"


@contextlib.contextmanager
def implementation(name: str) -> Iterator[None]:
    """Run the block with the ``'compiled'`` or ``'reference'`` kernels, then restore.

    Raises:
        ValueError: ``name`` is neither.
        RuntimeError: ``'compiled'`` was asked for but the extension is not loaded (not
            built, or ``DISTEMB_NO_EXT=1``).
    """
    global _impl
    if name not in _IMPLS:
        raise ValueError(f"name: expected 'compiled' or 'reference', got {name!r}")
    if _IMPLS[name] is None:
        raise RuntimeError("the compiled kernels are not loaded (not built, or "
                           "DISTEMB_NO_EXT=1): only 'reference' is available")
    saved, _impl = _impl, _IMPLS[name]
    try:
        yield
    finally:
        _impl = saved


# Waking a sleeping OpenMP thread (OMP_WAIT_POLICY=passive) costs tens of microseconds,
# about the time to stream this many floats through one core: below it, extra threads
# only add a fork/join.
MIN_FLOATS_PER_THREAD = 1 << 15


_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


def _threads(num_threads, num_floats):
    """Threads worth using for ``num_floats`` of work, at most ``num_threads``."""
    if num_threads == 1 and type(num_threads) is int:  # the usual case, answered first
        return 1
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) \
            or num_threads < 1:
        raise ValueError(f"num_threads: expected a positive int, got {num_threads!r}")
    return int(max(1, min(num_threads, num_floats // MIN_FLOATS_PER_THREAD)))


def _ids(name, a):
    """``a`` as a C-contiguous int64 array (int32 ids are widened; no other conversion)."""
    if type(a) is np.ndarray and a.dtype == _I64 and a.flags.c_contiguous:
        return a  # what every caller passes: nothing to convert
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype={a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _grads(a):
    """``a`` as C-contiguous float32; other dtypes raise rather than round-trip silently."""
    if type(a) is not np.ndarray:
        a = np.asarray(a)
    if a.dtype != _F32:
        raise TypeError(f"grads: expected float32, got dtype={a.dtype}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _check_table(name, a, rows_like=None, ndim=2):
    flags = getattr(a, "flags", None)
    if not isinstance(a, np.ndarray) or a.dtype != _F32 or a.ndim != ndim \
            or not flags.c_contiguous or not flags.writeable:
        raise TypeError(f"{name}: expected a writeable C-contiguous float32 array of {ndim} "
                        f"dims, got {type(a).__name__} dtype={getattr(a, 'dtype', None)}, "
                        f"ndim={getattr(a, 'ndim', None)}")
    if rows_like is not None and a.shape[:ndim] != rows_like.shape[:ndim]:
        raise ValueError(f"{name}: expected shape {rows_like.shape[:ndim]} (as weight), "
                         f"got {a.shape}")


def _check_rows(rows, grads, weight):
    if rows.ndim != 1:
        raise ValueError(f"rows: expected a 1-d array, got shape {rows.shape}")
    if grads.ndim != 2 or grads.shape[0] != rows.shape[0] or grads.shape[1] != weight.shape[1]:
        raise ValueError(f"grads: expected shape ({rows.shape[0]}, {weight.shape[1]}), "
                         f"got {tuple(grads.shape)}")


def dedup_sum(ids: GlobalIds, grads: Rows, num_rows: Optional[int] = None,
              out: Optional[Rows] = None, num_threads: int = 1) -> Tuple[UniqueIds, Rows]:
    """Deduplicate ``ids`` and sum the gradient rows of each duplicate.

    Rows of equal ids are summed in batch order, so the result is deterministic and
    independent of ``num_threads``.

    Args:
        ids: (N,) integer ids, any order, duplicates allowed.
        grads: (N, D) float32 gradient rows, one per id.
        num_rows: unused on the CPU (the sort finds the id range itself); part of the
            contract for the CUDA sort.
        out: optional reusable (M, D) float32 C-contiguous buffer with M >= N; the sums
            are written to its first U rows and a view of them is returned. Reuse it only
            once the previous result is no longer needed (the optimizer's step owns one:
            ``push_update`` consumes the sums before returning).

    Returns:
        (uniq, summed): ascending unique ids (int64) and their (U, D) float32 sums.
    """
    ids = _ids("ids", ids).reshape(-1)
    grads = _grads(grads)
    if grads.ndim != 2 or grads.shape[0] != ids.shape[0]:
        raise ValueError(f"grads: expected shape ({ids.shape[0]}, D), got {tuple(grads.shape)}")
    if out is not None:
        _check_table("out", out)
        if out.shape[0] < ids.shape[0] or out.shape[1] != grads.shape[1]:
            raise ValueError(f"out: expected shape (>= {ids.shape[0]}, {grads.shape[1]}), "
                             f"got {out.shape}")
    return _impl.dedup_sum(ids, grads, num_rows=num_rows, out=out,
                           num_threads=_threads(num_threads, grads.size))


def gather_rows(table: Rows, rows: GlobalIds, out: Optional[Rows] = None,
                num_threads: int = 1) -> Rows:
    """Copy ``table[rows]`` into ``out`` (allocated when None) and return it.

    Args:
        table: (R, D) float32 C-contiguous array.
        rows: (N,) integer row ids, each in [0, R) (checked by the caller).
        out: optional (N, D) float32 C-contiguous destination, e.g. a buffer the caller
            reuses across calls when it does not hand the rows on to someone who keeps them.
        num_threads: OpenMP threads.

    Returns:
        ``out``.
    """
    if not isinstance(table, np.ndarray) or table.dtype != _F32 or table.ndim != 2 \
            or not table.flags.c_contiguous:
        raise TypeError(f"table: expected a C-contiguous float32 2-d array, got "
                        f"dtype={getattr(table, 'dtype', None)}")
    rows = _ids("rows", rows)
    if rows.ndim != 1:
        raise ValueError(f"rows: expected a 1-d array, got shape {rows.shape}")
    if out is None:
        out = np.empty((rows.shape[0], table.shape[1]), dtype=np.float32)
    elif (not isinstance(out, np.ndarray) or out.shape != (rows.shape[0], table.shape[1])
          or out.dtype != _F32 or not out.flags.c_contiguous):
        raise ValueError(f"out: expected a C-contiguous float32 array of shape "
                         f"{(rows.shape[0], table.shape[1])}, got "
                         f"{getattr(out, 'dtype', None)} {getattr(out, 'shape', None)}")
    _impl.gather_rows(table, rows, out, num_threads=_threads(num_threads, out.size))
    return out


def rowwise_adagrad_update(weight: Rows, state_sum: Array, rows: UniqueIds, grads: Rows,
                           clr: float, eps: float, num_threads: int = 1) -> None:
    """In place, row-wise Adagrad (one accumulator per row: the mean of g^2)."""
    _check_table("weight", weight)
    _check_table("state_sum", state_sum, weight, ndim=1)
    rows, grads = _ids("rows", rows), _grads(grads)
    _check_rows(rows, grads, weight)
    _impl.rowwise_adagrad_update(weight, state_sum, rows, grads, float(clr), float(eps),
                                 num_threads=_threads(num_threads, grads.size))


def adam_update(weight: Rows, exp_avg: Rows, exp_avg_sq: Rows, rows: UniqueIds, grads: Rows,
                lr: float, beta1: float, beta2: float, eps: float, step: int,
                row_steps: Optional[Array] = None, num_threads: int = 1) -> None:
    """In place, torch.optim.SparseAdam's rule on unique ``rows``.

    ``step`` is the global step (torch semantics); with ``row_steps`` (int64, one per
    table row) each row counts and bias-corrects its own steps instead.
    """
    _check_table("weight", weight)
    _check_table("exp_avg", exp_avg, weight)
    _check_table("exp_avg_sq", exp_avg_sq, weight)
    if row_steps is not None and (
            not isinstance(row_steps, np.ndarray) or row_steps.dtype != np.int64
            or row_steps.shape != weight.shape[:1] or not row_steps.flags.c_contiguous):
        raise TypeError(f"row_steps: expected a C-contiguous int64 array of shape "
                        f"{weight.shape[:1]}, got {getattr(row_steps, 'dtype', None)} "
                        f"{getattr(row_steps, 'shape', None)}")
    rows, grads = _ids("rows", rows), _grads(grads)
    _check_rows(rows, grads, weight)
    _impl.adam_update(weight, exp_avg, exp_avg_sq, rows, grads, float(lr), float(beta1),
                      float(beta2), float(eps), int(step), row_steps=row_steps,
                      num_threads=_threads(num_threads, grads.size))


def _elementwise(rule: rule_table.ElementwiseRule):
    """The validating wrapper of an element-wise rule's update, made from its table entry:
    weight and each state a writeable C-contiguous float32 (R, D) array, the positive
    hyperparameters positive, rows and grads as :func:`dedup_sum` takes them."""
    states = "".join(f"{s}, " for s in rule.states)
    source = (
        f"def {rule.kernel}({rule.params()}):\n"
        "    _check_table('weight', weight)\n"
        + "".join(f"    _check_table({s!r}, {s}, weight)\n" for s in rule.states)
        + rule_table.checks(rule)
        + "    rows, grads = _ids('rows', rows), _grads(grads)\n"
          "    _check_rows(rows, grads, weight)\n"
          f"    _impl.{rule.kernel}(weight, {states}rows, grads, {rule_table.floats(rule)},\n"
          "                        num_threads=_threads(num_threads, grads.size))\n")
    doc = (f"In place on unique ``rows``: {rule.summary}\n\n"
           f"The states ({', '.join(rule.states) or 'none'}) are (R, D) float32 arrays like "
           "``weight``; see :mod:`distemb.kernels.ops` for the contract.")
    return rule_table.define(source, globals(), rule.kernel, doc)


# sgd_update, adagrad_update, ftrl_update, ...: one per rule of the table.
for _rule in rule_table.RULES:
    globals()[_rule.kernel] = _elementwise(_rule)
del _rule
