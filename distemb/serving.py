"""Serving: a trained table read from its checkpoint into a read-only torch module.

:func:`load` reads one table of a checkpoint directory (:mod:`distemb.kvstore.checkpoint.snapshot`'s
format, of any version: written by one process, by any number of servers or of
collective ranks, for any store kind; a full save and the incremental saves after it,
replayed in order) without a KVClient, a context or an optimizer:

- a table of the fixed keys 0..N-1 (a dense or a file table) becomes a frozen
  ``torch.nn.Embedding`` (``torch.nn.EmbeddingBag`` with ``mode=``): torch's own modules,
  which ``torch.export`` exports and TorchScript scripts. With ``mmap=path`` its rows are
  written to that file and memory-mapped, for rows larger than RAM (the operating system
  pages them in as lookups touch them);
- a hash table (any int64 key) becomes a :class:`KeyedEmbedding`: a frozen hash index of
  the saved keys (the compiled open-addressing table of :mod:`distemb.kernels.hashtable`)
  beside their rows; a key the checkpoint lacks raises
  :class:`~distemb.errors.MissingKeyError`, or gets the row ``default`` says (the
  table's initialiser, such as ``key_normal(dim)``, or one fixed row).

Rows are float32 (what the training table's lookups return), or ``dtype=torch.float16``
/ ``torch.bfloat16`` (rounded to nearest-even: half the bytes). Every block read is
CRC-checked, and a fixed-key table must be covered exactly once, as a training load
checks it (:func:`~distemb.kvstore.checkpoint.snapshot.load_shard`).

Example:
    >>> import os, tempfile, torch, distemb
    >>> from distemb import serving
    >>> ctx = distemb.DistContext.embedded()
    >>> emb = distemb.DistEmbedding(100, 4, name="doc-served", context=ctx,
    ...                             init_func=lambda s, d: torch.randn(s, dtype=d))
    >>> opt = distemb.SparseAdagrad([emb], lr=0.1)
    >>> path = os.path.join(tempfile.mkdtemp(), "ck")
    >>> opt.save(path)
    >>> served = serving.load(path)
    >>> type(served).__name__, served.weight.requires_grad
    ('Embedding', False)
    >>> ids = torch.tensor([3, 99])
    >>> torch.equal(served(ids), emb(ids).detach())
    True
    >>> ctx.close()
"""
import os
from typing import Callable, Optional, Union

import numpy as np
import torch

from distemb.bags import Bags
from distemb.enums import BagMode
from distemb.errors import KVStoreError, MissingKeyError
from distemb.kernels.hashtable import HashIndex, keys_array
from distemb.kvstore.checkpoint import chain, snapshot
from distemb.kvstore.checkpoint.manifest import entry_keys, read_manifest
from distemb.kvstore.limits import check_fits, free_space
from distemb.rules import state_owner
from distemb.stores.types import WEIGHT

#: Row dtypes a served table may have.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Bytes a hash index takes per key, at most (buckets of key and slot at load 0.5 and up).
INDEX_BYTES_PER_KEY = 32

Default = Union[None, Callable, torch.Tensor]


class KeyedEmbedding(torch.nn.Module):
    """A read-only table of any int64 key: a frozen hash index of its keys and their rows.

    ``module(keys)`` returns the rows of ``keys`` (any shape, + (dim,)); with ``mode``,
    ``module(keys, offsets, per_sample_weights)`` pools them as ``torch.nn.EmbeddingBag``
    does (2-D keys, or 1-D keys and offsets). The index lives on the host; ``.to(device)``
    moves the rows, and lookups return rows there.

    Args:
        keys: (U,) distinct int64 keys.
        weight: (U, D) their rows (row i is key i's).
        default: what a key not in ``keys`` gives: None raises
            :class:`~distemb.errors.MissingKeyError`; a callable ``default(keys) -> rows``
            (an int64 numpy array to (n, D) rows: the training table's initialiser, e.g.
            :func:`~distemb.stores.key_normal`) or one (D,) row gives that row.
        mode: None, or 'sum', 'mean' or 'max': pool the rows of bags.
        name: the table's name, for messages.

    Raises:
        ValueError: duplicate keys, rows not one per key, a default row of another length.

    Example:
        >>> import numpy as np, torch
        >>> t = KeyedEmbedding(np.array([10, -3]), torch.tensor([[1.0], [2.0]]),
        ...                    default=torch.zeros(1))
        >>> t(torch.tensor([[-3, 7]])).tolist()
        [[[2.0], [0.0]]]
    """

    def __init__(self, keys, weight: torch.Tensor, default: Default = None,
                 mode: Optional[str] = None, name: str = "table"):
        super().__init__()
        keys = keys_array(keys)
        if weight.dim() != 2 or weight.shape[0] != len(keys):
            raise ValueError(f"weight: expected ({len(keys)}, dim) rows, one per key, got "
                             f"shape {tuple(weight.shape)}")
        self.index = HashIndex(capacity=len(keys))
        _, new = self.index.find_or_insert(keys)
        if not new.all():
            raise ValueError(f"keys: expected distinct keys, got {int((~new).sum())} "
                             f"repeated (first: {int(keys[~new][0])})")
        self.register_buffer("keys", torch.from_numpy(keys))
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if isinstance(default, torch.Tensor) and tuple(default.shape) != (weight.shape[1],):
            raise ValueError(f"default: expected one row of shape ({weight.shape[1]},), got "
                             f"shape {tuple(default.shape)}")
        if default is not None and not callable(default) and \
                not isinstance(default, torch.Tensor):
            raise TypeError(f"default: expected None, a callable keys -> rows or a row "
                            f"tensor, got {type(default).__name__}")
        self.default = default
        self.mode = None if mode is None else BagMode.parse(mode, "mode", ValueError)
        self.name = name

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def __len__(self):
        return len(self.keys)

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        """The rows of ``keys`` (any shape), shaped as ``keys`` + (dim,).

        Raises:
            MissingKeyError: a key not held, without a ``default``.
            TypeError: keys that are not integers.
        """
        flat = keys_array(keys.detach().cpu().numpy() if isinstance(keys, torch.Tensor)
                          else np.asarray(keys), "keys")
        slots = self.index.find(flat)
        missing = slots < 0
        dev = self.weight.device
        if not missing.any():
            out = self.weight[torch.from_numpy(slots).to(dev)]
        else:
            absent = flat[missing]
            if self.default is None:
                raise MissingKeyError(
                    f"keys: {len(absent)} of {len(flat)} keys are not in table "
                    f"{self.name!r} (first: {int(absent[0])}); load it with default= (its "
                    f"initialiser, or a row) to serve keys it never saw")
            if isinstance(self.default, torch.Tensor):
                fill = self.default.to(dev, self.weight.dtype).expand(len(absent), -1)
            else:
                fill = torch.as_tensor(np.asarray(self.default(absent))).to(
                    dev, self.weight.dtype)
            out = self.weight.new_empty((len(flat), self.embedding_dim))
            held = torch.from_numpy(~missing).to(dev)
            out[held] = self.weight[torch.from_numpy(slots[~missing]).to(dev)]
            out[~held] = fill
        shape = tuple(keys.shape) if isinstance(keys, torch.Tensor) else np.shape(keys)
        return out.reshape(tuple(shape) + (self.embedding_dim,))

    def forward(self, keys: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of ``keys``; pooled per bag when the module has a ``mode`` (the rows of
        the bags' unique keys looked up once, as :meth:`DistEmbedding.bag
        <distemb.embedding.DistEmbedding.bag>` does)."""
        if self.mode is None:
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("offsets, per_sample_weights: this module looks rows up "
                                 "one per key; load it with mode= to pool bags")
            return self.rows(keys)
        bags = Bags.of(keys, offsets, self.mode, per_sample_weights)
        return bags.pool(self.rows(bags.unique))


def tables(checkpoint) -> list:
    """The names of the tables in checkpoint directory ``checkpoint``.

    Raises:
        KVStoreError: it is not a complete distemb checkpoint.
    """
    manifest = read_manifest(os.fspath(checkpoint))
    return sorted(n for n in manifest["tensors"] if state_owner(n) is None)


def load(checkpoint, table: Optional[str] = None, *, dtype=torch.float32,
         mode: Optional[str] = None, default: Default = None,
         mmap: Optional[str] = None) -> torch.nn.Module:
    """Read a table of a checkpoint into a read-only module (see the module docstring).

    Args:
        checkpoint: a checkpoint directory (``opt.save(path)``'s).
        table: the table's name; None: the checkpoint's only table.
        dtype: the rows' dtype: ``torch.float32`` (the default: the training table's
            lookups, bit for bit), ``torch.float16`` or ``torch.bfloat16`` (or a name).
        mode: None for one row per id; 'sum', 'mean' or 'max' to pool bags
            (``torch.nn.EmbeddingBag``'s modes).
        default: a hash table's answer to a key it does not hold (see
            :class:`KeyedEmbedding`); a table of fixed keys takes none.
        mmap: a file to write the rows to and memory-map (a table of fixed keys; made or
            overwritten): for rows larger than memory. None: the rows in memory.

    Returns:
        ``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` (frozen) for a table of the
        keys 0..N-1; :class:`KeyedEmbedding` for a hash table.

    Raises:
        KVStoreError: not a checkpoint directory (a single ``.npz`` file of the format
            before version 2 is not read), a corrupt or missing segment, a save of its
            chain missing or out of order, rows not covered exactly once, or rows that do not fit in memory (pass ``mmap``) or on the
            disk of ``mmap``.
        ValueError: no such table (the message lists them), several tables and no
            ``table``, an unknown ``dtype`` or ``mode``; ``default`` or ``mmap`` for a
            table that takes none.
    """
    directory = os.path.abspath(os.fspath(checkpoint))
    if os.path.isfile(directory):
        raise KVStoreError(f"checkpoint: {directory} is a file (a single-file checkpoint of "
                           f"the format before version 2?); load it into its table with "
                           f"opt.load() and save it again to serve it")
    saves = chain.read_chain(directory)
    names = sorted(n for n in saves[-1]["tensors"] if state_owner(n) is None)
    if table is None:
        if len(names) != 1:
            raise ValueError(f"table: {directory} holds {len(names)} tables {names[:10]}; "
                             f"name the one to serve")
        table = names[0]
    elif table not in names:
        raise ValueError(f"table: expected one of {names[:10]} in {directory}, got "
                         f"{table!r}")
    tdtype = _dtype(dtype)
    mode = None if mode is None else BagMode.parse(mode, "mode", ValueError)
    entry = chain.chain_entry(saves, table, directory)
    rows, dim = _shape(entry, table)
    if rows is None:  # a hash table: any int64 key
        if mmap is not None:
            raise ValueError(f"mmap: {table!r} is a hash table, whose keys and rows are "
                             f"read into memory; mmap is for tables of fixed keys")
        keys, weight = _read_keyed(directory, entry, dim, tdtype, table)
        return KeyedEmbedding(keys, weight, default, mode, table)
    if default is not None:
        raise ValueError(f"default: {table!r} holds the fixed keys 0..{rows - 1}, each "
                         f"with its row; a default is for hash tables")
    weight = _read_fixed(directory, entry, rows, dim, tdtype, mmap, table)
    if mode is None:
        return torch.nn.Embedding.from_pretrained(weight, freeze=True)
    return torch.nn.EmbeddingBag.from_pretrained(weight, freeze=True, mode=mode.value)


def _dtype(dtype) -> torch.dtype:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)} (or torch's), got "
                         f"{dtype!r}")
    return DTYPES[name]


def _shape(entry, table):
    """(N or None, D) of a table entry (an embedding table: rows of one dimension)."""
    shape = entry.get("shape")
    ok = isinstance(shape, list) and len(shape) == 2 and isinstance(shape[1], int) and \
        shape[1] >= 1 and (shape[0] is None or (isinstance(shape[0], int) and shape[0] >= 1))
    if not ok:
        raise ValueError(f"table: {table!r} has shape {shape!r}; expected [rows or None, "
                         f"dim] (a table of rows of one dimension)")
    return shape[0], shape[1]


def _read_fixed(directory, entry, n, dim, dtype, mmap, table):
    """(n, dim) rows of keys 0..n-1, each covered exactly once, in memory or ``mmap``."""
    nbytes = n * dim * torch.tensor([], dtype=dtype).element_size()
    if mmap is None:
        try:
            check_fits(nbytes, f"the rows of {table!r}")
        except KVStoreError as e:
            raise KVStoreError(f"{e}; pass mmap=<file> to memory-map them") from None
        out = torch.empty((n, dim), dtype=dtype)
    else:
        path = os.path.abspath(os.fspath(mmap))
        room = free_space(os.path.dirname(path))
        held = os.path.getsize(path) if os.path.isfile(path) else 0
        if nbytes > room + held:
            raise KVStoreError(f"mmap: the rows of {table!r} take {nbytes:,} bytes, "
                                        f"{os.path.dirname(path)} has {room:,} free")
        if os.path.exists(path):
            os.remove(path)  # a fresh file of the rows' size (from_file extends it)
        out = torch.from_file(path, shared=True, size=n * dim, dtype=dtype).view(n, dim)

    def write(column, places, rows):
        out[torch.from_numpy(places)] = torch.from_numpy(rows).to(dtype)

    snapshot.load_shard(directory, entry, {WEIGHT: ((dim,), "float32")},
                        snapshot.Target.fixed(0, 1, n), write)
    return out


def _read_keyed(directory, entry, dim, dtype, table):
    """(keys, rows) of a hash table's entry, in the order the records hold them."""
    n = entry_keys(entry)
    check_fits(n * (dim * torch.tensor([], dtype=dtype).element_size() + 8 +
                    INDEX_BYTES_PER_KEY), f"the {n:,} keys and rows of {table!r}")
    keys = np.empty(n, np.int64)
    out = torch.empty((n, dim), dtype=dtype)
    filled = [0]

    def write(column, saved_keys, rows):
        lo = filled[0]
        hi = lo + len(saved_keys)
        if hi > n:
            raise KVStoreError(f"checkpoint: {table!r} holds more keys than its "
                                        f"records count ({n})")
        keys[lo:hi] = saved_keys
        out[lo:hi] = torch.from_numpy(rows).to(dtype)
        filled[0] = hi

    snapshot.load_shard(directory, entry, {WEIGHT: ((dim,), "float32")},
                        snapshot.Target.owned(lambda k: np.ones(len(k), bool)), write)
    return keys[:filled[0]], out[:filled[0]]
