"""GPU-resident keyed tables: hash tables whose rows and optimizer state live on a GPU.

A mixin of :class:`~distemb.kvstore.device.DeviceKVClient`, beside its dense GPU tables
in one namespace. Each such table is a keyed table of an embedded client of its own
(:class:`DeviceTables`, a :class:`~distemb.kvstore.local.LocalKVClient` whose stores are
made on the device: :class:`~distemb.stores.device.DeviceHashStore`), so what any keyed
table is (attaching by name, key management, optimizer state by name, ``state_dict``,
checkpoints in the one format, export and import) is the embedded client's, and only its
arrays differ: the key index is on the host, the weight and state columns are tensors on
the device, gathered and updated there by the client's kernels.

Keys cross to the host, where the index is (ids given on the device are copied there:
one wait for the device per lookup and per step, the index's price); rows and gradients
stay on the device. A step sums duplicate keys' gradients on the device
(``dedup_sum`` by key) and brings back only the unique keys.

Refused by name: a file table (its rows are files on the host) and a store object (it
lives in host memory); look their rows up onto a GPU with ``emb(ids, device=...)``.

Example:
    >>> from distemb.kvstore.device import DeviceKVClient
    >>> from distemb.stores.hash import HashTableSpec
    >>> kv = DeviceKVClient("cpu")  # a GPU in real use; 'cpu' shows the wiring
    >>> kv.create_table("users", HashTableSpec(4))
    >>> kv.store("users").column("weight").device, kv.contains("users", [7]).tolist()
    (device(type='cpu'), [False])
"""
import numpy as np
import torch

from distemb.arrays import check_values_shape
from distemb.errors import KVStoreError
from distemb.kernels.hashtable import keys_array
from distemb.kvstore.local import LocalKVClient
from distemb.kvstore.types import refuse_store
from distemb.stores.device import DeviceHashStore
from distemb.stores.hash import HashTableSpec

#: What a refused table can do instead.
LOOK_UP_ONTO = "create it on the host and look its rows up onto the GPU with " \
               "emb(ids, device=...)"


class DeviceTables(LocalKVClient):
    """The embedded client holding a device client's keyed tables, their stores made on
    ``device`` with ``ops``/``half_ops`` (the device client's kernels)."""

    def __init__(self, device, ops, half_ops):
        super().__init__(num_threads=1)
        self.device, self.ops, self.half_ops = device, ops, half_ops

    def _make_store(self, spec):
        return DeviceHashStore.of_spec(spec, self.device, self.ops, self.half_ops)


class DeviceKeyedTables:
    """Mixin of DeviceKVClient: its keyed tables, held by a :class:`DeviceTables`. The
    client's storage and placement methods hand a keyed table (or a keyed table's state,
    by its name) to the methods here; see the module docstring."""

    def _init_device_keyed(self):
        self._keyed = DeviceTables(self.device, self.ops, self.half_ops)

    def _is_keyed_name(self, name):
        """Whether ``name`` is a keyed table or the optimizer state of one."""
        return self._keyed.is_keyed(name) or self._keyed.state_of(name) is not None

    def is_keyed(self, name):
        return self._keyed.is_keyed(name)

    def keyed_names(self):
        return self._keyed.keyed_names()

    def state_of(self, name):
        return self._keyed.state_of(name)

    @staticmethod
    def _host_keys(keys):
        """Keys (a tensor on any device, or an array) as host int64 keys."""
        if isinstance(keys, torch.Tensor):
            keys = keys.detach().to("cpu").numpy()
        return keys_array(np.asarray(keys), "keys")

    # -- tables and keys: the embedded client's -----------------------------------------

    def create_table(self, name, spec):
        """Make hash table ``name`` on the device (or attach to it: same spec).

        Raises:
            KVStoreError: ``spec`` is not a hash table's (a file table's rows are files
                on the host), or ``name`` exists with another spec or as a dense table.
        """
        if not isinstance(spec, HashTableSpec):
            raise refuse_store(self, name, f"a {spec.kind} store ({type(spec).__name__})",
                               f"it holds dense and hash tables on {self.device}, and a "
                               f"{spec.kind} table's rows stay in host memory; "
                               f"{LOOK_UP_ONTO}")
        if name in self._meta:
            raise KVStoreError(f"name {name!r} already exists in the KVStore (a dense "
                               "table); pick another name")
        self._keyed.create_table(name, spec)

    def add_table(self, name, store):
        """Refused: a store object lives in host memory.

        Raises:
            KVStoreError: always, naming the store and this client.
        """
        raise refuse_store(self, name, f"a {type(store).__name__}",
                           f"a store object lives in host memory; pass a HashTableSpec "
                           f"(DynamicEmbedding(..., device={str(self.device)!r})) to hold "
                           f"its rows on {self.device}, or {LOOK_UP_ONTO}")

    def store(self, name):
        return self._keyed.store(name)

    def dim(self, name):
        return self._keyed.dim(name)

    def storage_dtype(self, name):
        return self._keyed.storage_dtype(name)

    def size(self, name):
        return self._keyed.size(name)

    def capacity(self, name):
        return self._keyed.capacity(name)

    def remove(self, name, keys):
        return self._keyed.remove(name, self._host_keys(keys))

    def contains(self, name, keys):
        return self._keyed.contains(name, self._host_keys(keys))

    def get(self, name, keys):
        """Rows of held ``keys`` as a host float32 array (nothing inserted or counted)."""
        return self._keyed.get(name, self._host_keys(keys)).cpu().numpy()

    def evict(self, name, target_size, policy=None):
        return self._keyed.evict(name, target_size, policy)

    def export(self, name, columns=None):
        return self._keyed.export(name, columns)

    def import_(self, name, keys, columns):
        self._keyed.import_(name, self._host_keys(keys), columns)

    def flush(self, name):
        self._keyed.flush(name)

    # -- KVClient methods the device client inherits: a keyed table's, else its own ------

    def names(self):
        return super().names() + self._keyed.names()

    def data_meta(self, name):
        if self._is_keyed_name(name):
            return self._keyed.data_meta(name)
        return super().data_meta(name)

    def row_dim(self, name):
        return self.dim(name) if self.is_keyed(name) else super().row_dim(name)

    def init_optimizer(self, name, rule, options):
        if self.is_keyed(name):
            return self._keyed.init_optimizer(name, rule, options)
        return super().init_optimizer(name, rule, options)

    def table_state(self, name, state_names):
        if self.is_keyed(name):
            return self._keyed.table_state(name, state_names)
        return super().table_state(name, state_names)

    def load_table_state(self, name, state_names, entry):
        if self.is_keyed(name):
            return self._keyed.load_table_state(name, state_names, entry)
        return super().load_table_state(name, state_names, entry)

    def save_table(self, name, directory, save_id, columns):
        if self.is_keyed(name):
            return self._keyed.save_table(name, directory, save_id, columns)
        return super().save_table(name, directory, save_id, columns)

    def load_table(self, name, directory, entry, columns):
        if self.is_keyed(name):
            return self._keyed.load_table(name, directory, entry, columns)
        return super().load_table(name, directory, entry, columns)

    # -- a keyed table's storage and placement, for the client's methods ----------------

    def _keyed_ids_in(self, name, ids):
        """Host int64 keys of any shape, flat, and the shape (the index is on the host).

        Raises:
            TypeError: ``ids`` are not integers.
        """
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"ids: expected an integer tensor (int32 or int64), got {t.dtype}")
        return self._host_keys(t.reshape(-1).to(torch.int64)), tuple(t.shape)

    def _keyed_values_in(self, name, values, ids_shape):
        """float32 rows for keys of shape ``ids_shape`` of ``name``, on the device, shaped
        as the keys + (dim,) or (number of keys, dim): float32 values, or values in the
        table's own 16-bit dtype (exact in float32).

        Raises:
            TypeError: another dtype. ValueError: another shape.
        """
        t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
        got, own = str(t.dtype).replace("torch.", ""), self.storage_dtype(name)
        if got != "float32" and got != own:
            also = f" (or {own})" if own != "float32" else ""
            raise TypeError(f"values: expected dtype float32{also} for {name!r}, got {got}")
        want = check_values_shape(name, t.shape, ids_shape, (self.dim(name),))
        return t.to(self.device, torch.float32).reshape(want)
