"""DistEmbedding: a sharded embedding table that records a trace while autograd records."""
import warnings

from distemb.errors import TraceOverflowError
from distemb.kvstore.device import cuda_device
from distemb.tensor import DistTensor

DEFAULT_TRACE_LIMIT = 1024


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}: expected a positive int, got {value!r}")
    return value


class DistEmbedding:
    """A learnable table of ``num_embeddings`` rows, sparsely updated by distemb optimizers.

    A drop-in for ``dgl.distributed.DistEmbedding``: ``emb(ids)`` returns the rows; while
    autograd records it also appends ``(ids, rows)`` to a trace. The optimizer's
    ``step()`` applies and removes the lookups whose backward has run; ``zero_grad()``
    drops those (gradients of earlier backward passes) and keeps lookups still waiting
    for their backward. Lookups under ``torch.no_grad()`` record nothing.

    Args:
        num_embeddings: number of rows (the table is not tied to a graph's node count).
        embedding_dim: length of each row.
        name: KVStore name; tables of the same name share storage.
        init_func: ``init_func(shape, dtype)`` initialises each shard (zeros when None,
            as in DGL).
        part_policy: sharding of the rows (default: even ranges over the servers).
        context: the :class:`~distemb.context.DistContext` (default: the current one).
        trace_limit: lookups recorded before a missing ``step()``/``zero_grad()`` raises
            :class:`~distemb.errors.TraceOverflowError` (a warning is issued at half).
        device: where the table lives: None or 'cpu' (host memory or the servers), or a
            CUDA device (embedded contexts only): the table is then one tensor on that GPU,
            looked up and updated there with the CUDA kernels.

    Raises:
        CudaUnavailableError: ``device`` is a CUDA device and the CUDA kernels cannot
            run here (not built, CPU-only torch or no GPU; the message says which).
        DistEmbError: ``device`` is a CUDA device in a trainer context of a cluster.

    Example:
        >>> import torch
        >>> emb = DistEmbedding(10, 4, name="doc-emb",
        ...                     init_func=lambda shape, dtype: torch.ones(shape, dtype=dtype))
        >>> rows = emb(torch.tensor([1, 1, 7]))
        >>> rows.shape, len(emb.trace)
        (torch.Size([3, 4]), 1)
        >>> from distemb.kernels.cuda import CudaUnavailableError, cuda_available
        >>> try:  # rows on a GPU, gradients summed there by the optimizer
        ...     rows = emb(torch.tensor([1, 1, 7]), device="cuda")
        ... except CudaUnavailableError as e:  # raised before any copy, with the reason
        ...     assert not cuda_available()
    """

    def __init__(self, num_embeddings, embedding_dim, name=None, init_func=None,
                 part_policy=None, context=None, trace_limit=DEFAULT_TRACE_LIMIT, device=None):
        _positive_int(num_embeddings, "num_embeddings")
        _positive_int(embedding_dim, "embedding_dim")
        self._tensor = DistTensor((num_embeddings, embedding_dim), "float32", name=name,
                                  init_func=init_func, part_policy=part_policy,
                                  persistent=True, context=context, device=device)
        self._F = self._tensor.context.F
        self._trace = []
        self._trace_limit = _positive_int(trace_limit, "trace_limit")
        self._optm_state = None

    def __call__(self, idx, device=None):
        """Rows ``idx`` (int32/int64, any shape) on ``device``; traced while recording.

        Args:
            idx: ids, any shape.
            device: where the rows go (default: where the table lives, 'cpu' for host
                tables). With a CUDA device, the optimizer sums their gradients there.

        Raises:
            CudaUnavailableError: ``device`` is a CUDA device that cannot be used here.
        """
        F = self._F
        if device is not None and str(device).startswith("cuda"):
            device = cuda_device(device)  # the reason it cannot be used, before any copy
        ids, shape = self._tensor._ids(idx)
        rows = self._tensor._pull(ids, shape)
        if device is not None:
            rows = F.copy_to(rows, device)
        if F.is_recording():
            n = len(self._trace)
            if n >= self._trace_limit:
                raise TraceOverflowError(
                    f"DistEmbedding {self.name!r}: {n} lookups recorded without an "
                    "optimizer step() or zero_grad(); call one every iteration, or wrap "
                    "inference in torch.no_grad() (raise trace_limit if this is intended)")
            if n == self._trace_limit // 2:
                warnings.warn(f"DistEmbedding {self.name!r}: {n} lookups recorded since the "
                              "last step()/zero_grad()", ResourceWarning, stacklevel=2)
            rows = F.attach_grad(rows)
            self._trace.append((ids, rows))
        return rows

    def reset_trace(self):
        """Forget every recorded lookup, including those still waiting for backward."""
        self._trace = []

    def pop_gradients(self):
        """Remove the recorded lookups whose backward has run and return them.

        Lookups still waiting for their backward stay recorded (torch semantics: a
        gradient that arrives after ``step()`` is applied by the next one).

        Returns:
            list of ``(ids, grad)``: the flat int64 ids and their ``(len(ids), dim)``
            gradients, in lookup order.
        """
        done = [(ids, rows.grad) for ids, rows in self._trace if rows.grad is not None]
        self._trace = [(ids, rows) for ids, rows in self._trace if rows.grad is None]
        return [(ids, g.reshape(-1, self.embedding_dim)) for ids, g in done]

    def drop_gradients(self):
        """Forget the lookups whose backward has run (``zero_grad()``); keep the rest.

        Why not clear everything: ``out = model(x); opt.zero_grad(); loss.backward();
        opt.step()`` (torch's idiom, DGL's examples) calls ``zero_grad()`` between the
        lookup and its backward; that lookup's gradient is the one to apply.
        """
        self._trace = [(ids, rows) for ids, rows in self._trace if rows.grad is None]

    @property
    def trace(self):
        """Recorded ``(ids, rows)`` pairs not yet consumed by step() or dropped by zero_grad()."""
        return list(self._trace)

    @property
    def name(self):
        return self._tensor.name

    @property
    def num_embeddings(self):
        return self._tensor.shape[0]

    @property
    def embedding_dim(self):
        return self._tensor.shape[1]

    @property
    def part_policy(self):
        return self._tensor.part_policy

    @property
    def weight(self):
        """The :class:`DistTensor` of the rows."""
        return self._tensor

    @property
    def kvstore(self):
        """The KVStore client holding the rows (a device client for a GPU table)."""
        return self._tensor.client

    @property
    def device(self):
        """The torch device of the table, or None for a host table (numpy rows)."""
        return self._tensor.device

    @property
    def optm_state(self):
        """KVStore names of the optimizer state, set when an optimizer adopts the table."""
        return self._optm_state

    def __repr__(self):
        return (f"DistEmbedding(name={self.name!r}, num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim})")
