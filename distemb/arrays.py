"""Names for what an array is, used in signatures across the layers (a leaf module).

An array here is a numpy array for host placements and a torch tensor for device
placements; the alias says what it holds, its docstring comment the shape and dtype.
Nothing is checked by these names: they document contracts that the functions using
them validate.
"""
from typing import Any, Tuple, Type

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
