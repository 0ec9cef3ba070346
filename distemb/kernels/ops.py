"""The kernel contract, declared once: every kernel implementation has these functions.

Implementations: :mod:`distemb.kernels` (validating wrappers around the compiled module
``distemb._kernels``), :mod:`distemb.kernels.reference` (the numpy twins),
``distemb._kernels`` itself (built from ``csrc/_kernels.pyx``), :mod:`distemb.kernels.cuda`
(ctypes wrappers of ``csrc/cuda``) and the CPU stand-in of the CUDA kernels in the tests.
``tests/test_kernel_contract.py`` compares each one's ``inspect.signature`` with this
Protocol's, so a drifted signature fails in CI rather than on a lent GPU.

Arrays are numpy arrays for the host implementations and torch tensors on one device for
the CUDA ones. Shared preconditions: tables and gradients are C-contiguous float32; ids
int64 (the host wrappers widen int32); ``rows`` passed to an update are unique and in
range (callers deduplicate and range-check: the kernels trust them); ``num_threads`` is
a positive int (the CUDA kernels ignore it). Updates are in place and return None.

The update kernels of the element-wise rules (``sgd_update``, ``adagrad_update``,
``ftrl_update``, ...) are declared from the one rule table,
:mod:`distemb.kernels.rule_table`: weight, the rule's (R, D) state arrays, rows, grads,
its hyperparameters, ``num_threads=1``. The others are written out below.
"""
import types
from typing import Optional, Protocol, Tuple, runtime_checkable

from distemb.arrays import Array, GlobalIds, Rows, UniqueIds
from distemb.kernels import rule_table


class _WrittenOut:
    """The contract's kernels that are not element-wise rules (see KernelOps)."""

    def dedup_sum(self, ids: GlobalIds, grads: Rows, num_rows: Optional[int] = None,
                  out: Optional[Rows] = None, num_threads: int = 1
                  ) -> Tuple[UniqueIds, Rows]:
        """Unique ids, ascending, and the sum of the gradient rows of each.

        Args:
            ids: (N,) int64 ids, any order, duplicates allowed.
            grads: (N, D) float32, one row per id.
            num_rows: an exclusive upper bound of the ids when known (lets the CUDA sort
                skip radix passes; the CPU sort finds the range itself).
            out: host only: a reusable (M >= N, D) float32 buffer; the sums are written to
                its first U rows and a view of them returned.
            num_threads: OpenMP threads.

        Returns:
            ``(uniq, summed)``: (U,) int64 and (U, D) float32. Rows of one id are summed in
            a fixed order, so the result does not depend on threads or runs.
        """

    def gather_rows(self, table: Rows, rows: GlobalIds, out: Optional[Rows] = None,
                    num_threads: int = 1) -> Rows:
        """``out[i] = table[rows[i]]`` for (R, D) ``table``; ``out`` (N, D) made when None."""

    def rowwise_adagrad_update(self, weight: Rows, state_sum: Array, rows: UniqueIds,
                               grads: Rows, clr: float, eps: float,
                               num_threads: int = 1) -> None:
        """Row-wise Adagrad: ``s += mean(g*g); w -= clr * g / (sqrt(s) + eps)``; s is (R,)."""

    def adam_update(self, weight: Rows, exp_avg: Rows, exp_avg_sq: Rows, rows: UniqueIds,
                    grads: Rows, lr: float, beta1: float, beta2: float, eps: float,
                    step: int, row_steps: Optional[Array] = None,
                    num_threads: int = 1) -> None:
        """torch.optim.SparseAdam on ``rows``.

        ``step`` is the global step count (torch semantics). With ``row_steps`` ((R,)
        int64), each row increments and bias-corrects with its own count instead.
        """


def _declared(rule):
    """The contract of an element-wise rule's update kernel, from its table entry."""
    doc = rule.summary + ("\n\n" + rule.doc if rule.doc else "")
    return rule_table.define(f"def {rule.kernel}(self, {rule.params()}) -> None:\n    pass\n",
                             globals(), rule.kernel, doc)


#: Names of the contract's functions, in declaration order.
KERNEL_NAMES = ("dedup_sum", "gather_rows") + rule_table.UPDATE_KERNELS


def _kernel_ops_body(namespace):
    namespace["__doc__"] = _KERNEL_OPS_DOC
    namespace["__module__"] = __name__
    for name in KERNEL_NAMES:
        namespace[name] = vars(_WrittenOut).get(name) or _declared(
            next(r for r in rule_table.RULES if r.kernel == name))


_KERNEL_OPS_DOC = """The kernel functions of one implementation (a module or an object).

    Every function of :data:`KERNEL_NAMES`; the element-wise rules' updates are declared
    from :mod:`distemb.kernels.rule_table`.

    Example:
        >>> from distemb import kernels
        >>> from distemb.kernels import reference
        >>> isinstance(kernels, KernelOps), isinstance(reference, KernelOps)
        (True, True)
    """

KernelOps = runtime_checkable(types.new_class("KernelOps", (Protocol,),
                                              exec_body=_kernel_ops_body))


@runtime_checkable
class DeviceKernelOps(KernelOps, Protocol):
    """The kernels of tables on a device: the contract, plus two that never wait for it.

    Implementations: :mod:`distemb.kernels.cuda` and the tests' CPU stand-in of it. Rows
    passed to the updates may also lie outside the table: those are skipped (the device
    client never waits to range-check ids, see :mod:`distemb.kvstore.device`).

    Example:
        >>> from distemb.kernels import cuda
        >>> isinstance(cuda, DeviceKernelOps)
        True
    """

    def dedup_sum_padded(self, ids: GlobalIds, grads: Rows, num_rows: int,
                         out: Optional[Rows] = None, num_threads: int = 1
                         ) -> Tuple[Array, Rows]:
        """``dedup_sum`` without learning the unique count U on the host.

        Args:
            ids: (N,) int64 ids; those outside [0, num_rows) are summed as ``num_rows``.
            grads: (N, D) float32, one row per id.
            num_rows: the table size, >= 1.
            out: a reusable (M >= N, D) float32 buffer for the sums.
            num_threads: ignored on a device.

        Returns:
            ``(uniq, summed)``: (N,) int64, the U unique ids ascending then ``num_rows``
            in every unused slot, and (N, D) float32 whose unused rows are unspecified.
        """

    def gather_rows_checked(self, table: Rows, rows: GlobalIds, flags: Array,
                            out: Optional[Rows] = None, num_threads: int = 1) -> Rows:
        """``gather_rows`` where ids outside the table read zeros and are counted.

        ``flags`` ((3,) int64: count, smallest, largest of the bad ids, starting at
        ``cuda.CLEAN_ID_FLAGS``) is updated in place, on the device, without a wait.
        """


#: Names of the device kernels beyond the contract, in declaration order.
DEVICE_KERNEL_NAMES = ("dedup_sum_padded", "gather_rows_checked")
