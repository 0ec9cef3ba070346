"""DistFeatureStore: PyG's ``FeatureStore`` over distemb tables, on any placement.

PyG's loaders (``NeighborLoader``, ``LinkNeighborLoader``) take a ``(FeatureStore,
GraphStore)`` pair instead of a ``Data`` object and read every node feature of a
mini-batch with one ``multi_get_tensor`` call. Here each ``(group_name, attr_name)`` of a
:class:`~torch_geometric.data.TensorAttr` is one distemb table (a
:class:`~distemb.tensor.DistTensor`, or a :class:`~distemb.embedding.DistEmbedding`
whose rows are read without being traced), and the ``index`` of the attribute is the
table's global row ids, so the features live wherever the tables do: in this process,
on servers, or sharded over the trainers of a collective job.

Example:
    >>> import torch
    >>> from distemb.pyg import DistFeatureStore
    >>> store = DistFeatureStore(prefix="doc-fs")
    >>> store["paper", "x", None] = torch.arange(6.).view(3, 2)
    >>> store["paper", "x", torch.tensor([2, 0])]
    tensor([[4., 5.],
            [0., 1.]])
    >>> store.get_tensor_size("paper", "x"), [a.attr_name for a in store.get_all_tensor_attrs()]
    ((3, 2), ['x'])
"""
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from distemb.context import current_context
from distemb.embedding import ROW_DTYPES, DistEmbedding
from distemb.grouped import grouped_lookup
from distemb.integrations.pyg import torch_geometric
from distemb.tensor import DistTensor

TensorAttr = torch_geometric.data.TensorAttr
#: The key of a table: (group_name, attr_name); a group is a node type, an edge type
#: (a tuple of three names) or None.
Key = Tuple[Any, Optional[str]]
Table = Union[DistTensor, DistEmbedding]

__all__ = ["DistFeatureStore", "table_name"]


def table_name(prefix: str, key: Key, generation: int = 0) -> str:
    """The distemb name of the ``generation``-th table a store with ``prefix`` makes for
    ``key``: ``"<prefix>:<group_name!r>:<attr_name!r>:<generation>"``."""
    group, attr = key
    return f"{prefix}:{group!r}:{attr!r}:{generation}"


def _rows(table: Table):
    """What ``t[ids]`` and ``t[ids] = v`` go through: a table's rows (a DistEmbedding's
    weight, read and written without a trace), or the DistTensor itself."""
    return table.weight if isinstance(table, DistEmbedding) else table


def _ids(index, what: str):
    """``index`` as the table takes it: a ``slice`` as it is, anything else as an int64
    tensor (numpy arrays, lists and single ints included)."""
    if isinstance(index, slice):
        return index
    if isinstance(index, np.ndarray):
        index = torch.from_numpy(index)
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        index = torch.tensor([int(index)])
    if not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.float16,
                                                              torch.bfloat16, torch.float32,
                                                              torch.float64):
        raise TypeError(f"{what}.index: expected integer ids (a tensor, a numpy array, an "
                        f"int), a slice or None, got {type(index).__name__} "
                        f"{getattr(index, 'dtype', '')}")
    return index.to(torch.int64)


class DistFeatureStore(torch_geometric.data.FeatureStore):
    """PyG's ``FeatureStore`` whose tensors are distemb tables.

    Every ``(group_name, attr_name)`` is one table: given to the constructor (any
    :class:`~distemb.tensor.DistTensor` or :class:`~distemb.embedding.DistEmbedding`,
    on any placement), or made by :meth:`put_tensor` the first time the pair is put.
    The ``index`` of a :class:`~torch_geometric.data.TensorAttr` is the table's global
    row ids (a node id for node features): ``get_tensor`` with an index returns those
    rows, with ``None`` (or ``:``) every row; ``put_tensor`` with an index writes those
    rows, with ``None`` rows ``0..len(tensor)-1``.

    A table this store makes for a new pair is a float table of rows (a DistEmbedding
    read and written without a trace) when the tensor is 2-d of a row dtype (float32,
    bfloat16, float16), otherwise a DistTensor of its shape and dtype (labels, 1-d or
    3-d features). It has ``index.max() + 1`` rows when put with an index (rows not
    written read as zeros), ``len(tensor)`` rows otherwise, and the distemb name
    :func:`table_name` ``(prefix, key, n)`` (the store's n-th table of that key). Making
    a table is collective, as in DGL (see DistTensor): with several trainers, each makes
    its stores and puts the same new pairs in the same order. :meth:`remove_tensor`
    forgets a pair; the rows of a table the store made stay in its context until the
    context closes (a table deleted when its last object is garbage collected would
    make its trainers meet at a different point each, as cycles are collected), and a
    table given to the constructor is left to its owner.

    ``multi_get_tensor`` (what PyG's loaders call once per mini-batch) reads the rows of
    every DistEmbedding-backed pair at once (:func:`distemb.grouped.grouped_lookup`:
    one exchange for all of them in a collective job); the other pairs are read in turn.

    Args:
        tables: ``{(group_name, attr_name): table}`` of tables to serve.
        prefix: the first part of the names of the tables this store makes (default: a
            fresh ``"pyg-<n>"`` of the context, the same on every trainer that makes its
            stores in the same order).
        context: the :class:`~distemb.context.DistContext` of the tables it makes
            (default: the current one).
        tensor_attr_cls: PyG's ``TensorAttr`` class or a subclass of it (as PyG's).

    Raises:
        TypeError: a table of ``tables`` that is neither a DistTensor nor a
            DistEmbedding, or a key that is not a (group_name, attr_name) pair.

    Example:
        >>> import torch, distemb
        >>> from distemb.pyg import DistFeatureStore
        >>> emb = distemb.DistEmbedding(4, 2, name="doc-fs-emb")
        >>> store = DistFeatureStore({("user", "emb"): emb})
        >>> store["user", "emb", torch.tensor([3])]
        tensor([[0., 0.]])
    """

    def __init__(self, tables: Optional[Mapping[Key, Table]] = None,
                 prefix: Optional[str] = None, context=None, tensor_attr_cls=None):
        super().__init__(tensor_attr_cls)
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise ValueError(f"prefix: expected a non-empty str (or None), got {prefix!r}")
        self._context = context or current_context()
        self._prefix = prefix or self._context.new_name("pyg")
        self._tables: Dict[Key, Table] = {}
        self._made: Dict[Key, int] = {}  # tables made per key: the next one's generation
        for key, table in (tables or {}).items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise TypeError(f"tables: expected (group_name, attr_name) keys, got {key!r}")
            if not isinstance(table, (DistTensor, DistEmbedding)):
                raise TypeError(f"tables[{key!r}]: expected a distemb DistTensor or "
                                f"DistEmbedding, got {type(table).__name__}")
            self._tables[key] = table

    @staticmethod
    def key(attr: TensorAttr) -> Key:
        """The table key of ``attr``: its ``(group_name, attr_name)``."""
        return (attr.group_name, attr.attr_name)

    def table(self, group_name, attr_name) -> Table:
        """The distemb table of ``(group_name, attr_name)``.

        Raises:
            KeyError: no table of that key.
        """
        return self._table(TensorAttr(group_name, attr_name))

    def _table(self, attr: TensorAttr) -> Table:
        try:
            return self._tables[self.key(attr)]
        except KeyError:
            raise KeyError(f"no table for {attr} in this {type(self).__name__} (it has "
                           f"{sorted(map(repr, self._tables))})") from None

    # -- PyG's FeatureStore ------------------------------------------------------------

    def _put_tensor(self, tensor, attr: TensorAttr) -> bool:
        """Write ``tensor`` to the rows ``attr.index`` of the key's table, making the
        table first if the key is new.

        Raises:
            ValueError: rows of another shape than the table's, or an empty index for a
                new table.
            TypeError: an index that is not ids, a slice or None.
        """
        tensor = torch.as_tensor(tensor)
        key = self.key(attr)
        index = None if attr.index is None else _ids(attr.index, "attr")
        if key not in self._tables:
            self._tables[key] = self._make(key, tensor, index)
        table = self._tables[key]
        if tuple(tensor.shape[1:]) != tuple(_rows(table).shape[1:]):
            raise ValueError(f"tensor: rows of shape {tuple(tensor.shape[1:])} for {attr}, "
                             f"whose table {table.name!r} has rows of shape "
                             f"{tuple(_rows(table).shape[1:])} (remove_tensor first to replace it)")
        _rows(table)[slice(0, len(tensor)) if index is None else index] = tensor
        return True

    def _make(self, key: Key, tensor: torch.Tensor, index: Optional[Any]) -> Table:
        if index is None or isinstance(index, slice):
            num_rows = len(tensor)
        elif index.numel() == 0:
            raise ValueError(f"index: a new table for {key!r} needs at least one row id, "
                             "got an empty index")
        else:
            num_rows = int(index.max()) + 1
        generation = self._made.get(key, 0)
        self._made[key] = generation + 1
        name = table_name(self._prefix, key, generation)
        dtype = str(tensor.dtype).replace("torch.", "")
        if tensor.dim() == 2 and dtype in ROW_DTYPES:
            return DistEmbedding(num_rows, tensor.shape[1], name=name, persistent=True,
                                 dtype=tensor.dtype, context=self._context)
        return DistTensor((num_rows,) + tuple(tensor.shape[1:]), tensor.dtype, name=name,
                          persistent=True, context=self._context)

    def _get_tensor(self, attr: TensorAttr) -> torch.Tensor:
        table = self._table(attr)
        index = slice(None) if attr.index is None else _ids(attr.index, "attr")
        rows = _rows(table)[index]
        if isinstance(attr.index, (int, np.integer)) and not isinstance(attr.index, bool):
            return rows[0]
        return rows

    def _multi_get_tensor(self, attrs: List[TensorAttr]) -> List[torch.Tensor]:
        """The rows of every attribute; those of DistEmbedding-backed keys indexed by ids
        in one grouped lookup (untraced), the others in turn."""
        out: List[Optional[torch.Tensor]] = [None] * len(attrs)
        grouped = []
        for i, attr in enumerate(attrs):
            table = self._table(attr)
            if isinstance(table, DistEmbedding) and isinstance(attr.index, torch.Tensor):
                grouped.append((i, table, _ids(attr.index, f"attrs[{i}]")))
            else:
                out[i] = self._get_tensor(attr)
        if grouped:
            with torch.no_grad():  # read as features: nothing for an optimizer to step
                rows = grouped_lookup([(table, ids) for _, table, ids in grouped])
            for (i, _, _), r in zip(grouped, rows):
                out[i] = r
        return out

    def _remove_tensor(self, attr: TensorAttr) -> bool:
        """Forget the key (a table this store made keeps its rows until its context
        closes)."""
        return self._tables.pop(self.key(attr), None) is not None

    def _get_tensor_size(self, attr: TensorAttr) -> Optional[Tuple[int, ...]]:
        table = self._tables.get(self.key(attr))
        return None if table is None else tuple(_rows(table).shape)

    def get_all_tensor_attrs(self) -> List[TensorAttr]:
        """One fresh attribute (index unset) per key: PyG's loaders set its index."""
        attrs = []
        for group, name in self._tables:
            attr = self._tensor_attr_cls.cast()
            attr.group_name, attr.attr_name = group, name
            attrs.append(attr)
        return attrs
