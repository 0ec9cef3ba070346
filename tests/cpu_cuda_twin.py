"""A CPU stand-in for :mod:`distemb.kernels.cuda`, for testing the device path without a GPU.

``CpuCudaTwin`` has the functions and keywords of :mod:`distemb.kernels.cuda` and checks
its inputs as strictly (torch tensors, exact dtypes, contiguous, one device), but takes
CPU torch tensors and runs :mod:`distemb.kernels.reference` on their numpy views, in
place. A :class:`~distemb.kvstore.device.DeviceKVClient` on device 'cpu' with this as its
``ops`` runs every line of the GPU dispatch except the CUDA kernels themselves. It counts
its calls, so a test can prove the device path (not the host one) ran. Test-only: it is
not part of the package.
"""
from collections import Counter

import torch

from distemb.kernels import reference


def _tensor(name, t, dtype, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != ndim or not t.is_contiguous():
        raise TypeError(f"{name}: expected a contiguous {dtype} tensor of {ndim} dims, got "
                        f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if t.device.type != "cpu":
        raise TypeError(f"{name}: the CPU twin takes CPU tensors, got {t.device}")
    return t.numpy()


class CpuCudaTwin:
    """The kernels.cuda functions on CPU torch tensors (see the module docstring)."""

    def __init__(self):
        self.calls = Counter()

    def dedup_sum(self, ids, grads, num_rows=None, out=None, num_threads=1):
        self.calls["dedup_sum"] += 1
        ids_np = _tensor("ids", ids, torch.int64, 1)
        grads_np = _tensor("grads", grads, torch.float32, 2)
        if num_rows is not None and ids_np.size and ids_np.max() >= num_rows:
            raise ValueError(f"ids: {ids_np.max()} >= num_rows {num_rows}")
        out_np = None if out is None else _tensor("out", out, torch.float32, 2)
        uniq, summed = reference.dedup_sum(ids_np, grads_np, out=out_np)
        return torch.from_numpy(uniq), (torch.from_numpy(summed) if out is None
                                        else out[:uniq.shape[0]])

    def gather_rows(self, table, rows, out=None, num_threads=1):
        self.calls["gather_rows"] += 1
        if out is None:
            out = torch.empty((rows.shape[0], table.shape[1]), dtype=torch.float32)
        reference.gather_rows(_tensor("table", table, torch.float32, 2),
                              _tensor("rows", rows, torch.int64, 1),
                              _tensor("out", out, torch.float32, 2))
        return out

    def sgd_update(self, weight, rows, grads, lr, num_threads=1):
        self.calls["sgd_update"] += 1
        reference.sgd_update(_tensor("weight", weight, torch.float32, 2),
                             _tensor("rows", rows, torch.int64, 1),
                             _tensor("grads", grads, torch.float32, 2), lr)

    def adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        self.calls["adagrad_update"] += 1
        reference.adagrad_update(_tensor("weight", weight, torch.float32, 2),
                                 _tensor("state_sum", state_sum, torch.float32, 2),
                                 _tensor("rows", rows, torch.int64, 1),
                                 _tensor("grads", grads, torch.float32, 2), clr, eps)

    def rowwise_adagrad_update(self, weight, state_sum, rows, grads, clr, eps, num_threads=1):
        self.calls["rowwise_adagrad_update"] += 1
        reference.rowwise_adagrad_update(_tensor("weight", weight, torch.float32, 2),
                                         _tensor("state_sum", state_sum, torch.float32, 1),
                                         _tensor("rows", rows, torch.int64, 1),
                                         _tensor("grads", grads, torch.float32, 2), clr, eps)

    def adam_update(self, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps,
                    step, row_steps=None, num_threads=1):
        self.calls["adam_update"] += 1
        steps = None if row_steps is None else _tensor("row_steps", row_steps, torch.int64, 1)
        reference.adam_update(_tensor("weight", weight, torch.float32, 2),
                              _tensor("exp_avg", exp_avg, torch.float32, 2),
                              _tensor("exp_avg_sq", exp_avg_sq, torch.float32, 2),
                              _tensor("rows", rows, torch.int64, 1),
                              _tensor("grads", grads, torch.float32, 2), lr, beta1, beta2,
                              eps, step, row_steps=steps)
