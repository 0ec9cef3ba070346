"""Names for what an array is, used in signatures across the layers (a leaf module).

An array here is a numpy array for host placements and a torch tensor for device
placements; the alias says what it holds, its docstring comment the shape and dtype.
Nothing is checked by these names: they document contracts that the functions using
them validate.
"""
import inspect
import operator
from typing import Any, Callable, Sequence, Tuple, Type

Array = Any
#: (N,) int64 global (type-wise) ids, validated against a table's policy; duplicates allowed.
GlobalIds = Array
#: (U,) int64 ascending unique ids.
UniqueIds = Array
#: (N,) int64 ids local to one shard, each in [0, shard rows).
LocalIds = Array
#: (N, D) float32 rows of a table (looked-up rows, gradients or summed gradients).
Rows = Array
#: A tensor of the trainer's backend (torch for 'pytorch', numpy for 'numpy').
Tensor = Any
#: The shape of a tensor, (rows,) + row shape.
Shape = Tuple[int, ...]


def check_shape(what: str, have, want, error: Type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``what`` when shape ``have`` is not ``want``."""
    if tuple(have) != tuple(want):
        raise error(f"{what} has shape {tuple(have)}, expected {tuple(want)}")


def _dim(s, shape) -> int:
    """One entry of ``shape`` as an int (numpy's, a 0-d integer tensor): never a float
    truncated, a str read as digits or a bool (Python's, numpy's or torch's) as a count."""
    try:
        if isinstance(s, (bool, str, bytes)) or \
                str(getattr(s, "dtype", "")) in ("bool", "torch.bool"):
            raise TypeError
        return operator.index(s)
    except TypeError:
        raise TypeError(f"shape: expected an int or a tuple of ints, got {shape!r} "
                        f"({type(s).__name__} {s!r} is not an int)") from None


def check_table_shape(shape) -> Shape:
    """A table's ``shape`` as a tuple of ints (an int alone is one dimension).

    Raises:
        TypeError: an entry that is not an int (a float is not truncated, a str is not
            read as digits, a bool is not a count).
        ValueError: no dimension, or a first one <= 0 or another < 0.
    """
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        dims = (_dim(shape, shape),)
    else:
        dims = tuple(_dim(s, shape) for s in shape)
    if not dims or dims[0] <= 0 or any(s < 0 for s in dims[1:]):
        raise ValueError(f"shape: expected a non-empty tuple with shape[0] > 0, got {dims}")
    return dims


def check_values_shape(name: str, have, ids_shape, row_shape) -> Shape:
    """The shape ``(num_ids,) + row_shape`` of the values written to rows ``ids`` of table
    ``name`` (``t[ids] = values``), when their shape ``have`` is the ids' shape + the row
    shape (as torch indexing takes it) or that flat shape (a row per id, as DGL's
    ``push`` takes it). Values of another shape with as many elements (a transposed
    batch) are never reshaped: that would scramble them.

    Raises:
        ValueError: another shape, naming ``values``, the shapes expected and the one got.
    """
    have, ids_shape, row_shape = tuple(have), tuple(ids_shape), tuple(row_shape)
    num_ids = 1
    for n in ids_shape:
        num_ids *= int(n)
    flat = (num_ids,) + row_shape
    shaped = ids_shape + row_shape
    if have not in (flat, shaped):
        also = f" (the ids' shape + the row shape) or {flat}" if shaped != flat else ""
        raise ValueError(f"values: expected shape {shaped}{also} for {num_ids} ids of "
                         f"{name!r}, got {have}")
    return flat


#: The two initialiser signatures: a dense table's shards, a keyed table's keys.
DENSE_INIT = ("shape", "dtype")
KEYED_INIT = ("keys",)


def check_init_func(init_func: Callable, takes: Sequence[str], what: str = "init_func") -> None:
    """TypeError, at construction, when ``init_func`` cannot be called with the
    arguments ``takes`` names (a dense table's ``(shape, dtype)`` or a keyed table's
    ``(keys)``), naming the argument (``what``: a table's ``init_func``, a store's
    ``init``), the signature expected and the one it has.

    Callables whose signature Python cannot read (some builtins) are accepted.

    Raises:
        TypeError: ``init_func`` is not callable, or takes other arguments.
    """
    if init_func is None:
        return
    if not callable(init_func):
        raise TypeError(f"{what}: expected a callable {what}({', '.join(takes)}) -> "
                        f"rows, got {type(init_func).__name__}")
    try:
        sig = inspect.signature(init_func)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*takes)
    except TypeError:
        other = KEYED_INIT if tuple(takes) == DENSE_INIT else DENSE_INIT
        has = tuple(p for p in sig.parameters)
        hint = (f" (that is the signature of a {'keyed' if other == KEYED_INIT else 'dense'}"
                " table's initialiser)") if len(has) == len(other) else ""
        raise TypeError(f"{what}: expected {what}({', '.join(takes)}) -> rows, got a "
                        f"function that takes ({', '.join(has)}){hint}") from None
