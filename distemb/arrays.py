"""Names for what an array is, used in signatures across the layers (a leaf module).

An array here is a numpy array for host placements and a torch tensor for device
placements; the alias says what it holds, its docstring comment the shape and dtype.
Nothing is checked by these names: they document contracts that the functions using
them validate.
"""
import inspect
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
