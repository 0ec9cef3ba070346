"""Every kernel implementation has the signatures declared in distemb/kernels/ops.py.

The contract is compared by parameter names, kinds and defaults (annotations are the
Protocol's business), for the validating host wrappers, the numpy twins, the compiled
module, the CUDA wrappers (importable without a GPU) and the tests' CPU stand-in of the
CUDA kernels. A twin whose signature drifts fails here, in CI, not on a lent GPU.
"""
import inspect

import pytest

from cpu_cuda_twin import CpuCudaHalfTwin, CpuCudaTwin
from distemb import kernels
from distemb.kernels import cuda, half, ops, reference
from distemb.kernels.cuda_half import CudaHalfOps

IMPLS = {"kernels": kernels, "reference": reference, "cuda": cuda, "cpu_cuda_twin": CpuCudaTwin(),
         "half": half, "half_stochastic": half.StochasticRounding(), "cuda_half": CudaHalfOps(),
         "cpu_cuda_half_twin": CpuCudaHalfTwin()}
if kernels.HAS_EXT:
    from distemb import _kernels

    IMPLS["compiled"] = _kernels


def shape_of(fn, drop_self=False):
    params = list(inspect.signature(fn).parameters.values())
    if drop_self:
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_protocol_lists_every_kernel():
    declared = [n for n, v in vars(ops.KernelOps).items()
                if callable(v) and not n.startswith("_")]
    assert tuple(declared) == ops.KERNEL_NAMES


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", ops.KERNEL_NAMES)
def test_signature_matches_the_contract(impl, name):
    want = shape_of(getattr(ops.KernelOps, name), drop_self=True)
    assert shape_of(getattr(IMPLS[impl], name)) == want, (
        f"{impl}.{name} drifted from distemb/kernels/ops.py")


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_implementations_satisfy_the_protocol(impl):
    assert isinstance(IMPLS[impl], ops.KernelOps)


def test_a_drifted_twin_is_caught(monkeypatch):
    """The comparison itself can fail: swap two parameters of one twin."""
    def adagrad_update(weight, state_sum, rows, grads, eps, clr, num_threads=1):
        pass

    monkeypatch.setattr(reference, "adagrad_update", adagrad_update)
    with pytest.raises(AssertionError, match="reference.adagrad_update drifted"):
        test_signature_matches_the_contract("reference", "adagrad_update")


DEVICE_IMPLS = {"cuda": cuda, "cpu_cuda_twin": CpuCudaTwin(), "cuda_half": CudaHalfOps(),
                "cpu_cuda_half_twin": CpuCudaHalfTwin()}


def test_device_protocol_lists_its_kernels():
    declared = [n for n, v in vars(ops.DeviceKernelOps).items()
                if callable(v) and not n.startswith("_")]
    assert tuple(declared) == ops.DEVICE_KERNEL_NAMES


@pytest.mark.parametrize("impl", sorted(DEVICE_IMPLS))
@pytest.mark.parametrize("name", ops.DEVICE_KERNEL_NAMES)
def test_device_kernels_match_their_contract(impl, name):
    want = shape_of(getattr(ops.DeviceKernelOps, name), drop_self=True)
    assert shape_of(getattr(DEVICE_IMPLS[impl], name)) == want, (
        f"{impl}.{name} drifted from distemb/kernels/ops.py")
    assert isinstance(DEVICE_IMPLS[impl], ops.DeviceKernelOps)
    assert not isinstance(reference, ops.DeviceKernelOps)  # the check can fail
