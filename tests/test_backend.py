"""One conformance suite for every backend of the F.* contract."""
import subprocess
import sys

import numpy as np
import pytest

from distemb.backend import BACKENDS, load_backend
from distemb.backend.contract import AUTOGRAD_FUNCTIONS, FUNCTIONS
from distemb.errors import BackendError


@pytest.fixture(params=BACKENDS)
def F(request):
    return load_backend(request.param)


def test_every_contract_function_exists_or_is_autograd(F):
    for fn in FUNCTIONS:
        if F.name == "numpy" and fn in AUTOGRAD_FUNCTIONS:
            with pytest.raises(BackendError, match=f"backend 'numpy' does not implement '{fn}'"):
                getattr(F, fn)
        else:
            assert callable(getattr(F, fn)), fn


def test_creation_and_dtypes(F):
    z = F.zeros((2, 3), "float32")
    assert F.shape(z) == (2, 3) and F.dtype_of(z) == "float32" and F.ndim(z) == 2
    assert F.dtype_of(F.empty((4,), "int64")) == "int64"
    assert F.to_numpy(F.arange(2, 5)).tolist() == [2, 3, 4]
    assert F.dtype_name(np.int32) == "int32" and F.dtype_name("float32") == "float32"
    with pytest.raises(TypeError, match="dtype: expected one of"):
        F.dtype_name("complex128")
    t = F.tensor([[1, 2], [3, 4]], "float32")
    assert F.is_tensor(t) and not F.is_tensor([1])


def test_numpy_roundtrip_is_zero_copy(F):
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    t = F.from_numpy(a)
    a[0, 0] = 42
    assert F.to_numpy(t)[0, 0] == 42


def test_row_operations(F):
    t = F.from_numpy(np.zeros((4, 2), np.float32))
    idx = F.tensor([1, 3], "int64")
    F.scatter_row_inplace(t, idx, F.tensor([[1, 1], [2, 2]], "float32"))
    assert F.to_numpy(F.gather_row(t, idx)).tolist() == [[1, 1], [2, 2]]
    F.index_add_inplace(t, F.tensor([0, 0], "int64"), F.tensor([[1, 0], [1, 0]], "float32"))
    assert F.to_numpy(t)[0].tolist() == [2, 0]
    u, inv = F.unique(F.tensor([5, 1, 5], "int64"), return_inverse=True)
    assert F.to_numpy(u).tolist() == [1, 5] and F.to_numpy(inv).tolist() == [1, 0, 1]
    c = F.cat([F.tensor([1], "int64"), F.tensor([2], "int64")])
    assert F.to_numpy(c).tolist() == [1, 2]
    assert F.shape(F.reshape(t, (8,))) == (8,)
    assert F.dtype_of(F.astype(t, "float64")) == "float64"
    assert F.device_of(t) == "cpu" and F.copy_to(t, "cpu") is not None


def test_autograd_functions_on_pytorch():
    F = load_backend("pytorch")
    t = F.attach_grad(F.zeros((2,), "float32"))
    assert F.is_recording()
    (t * 3).sum().backward()
    assert F.to_numpy(F.grad(t)).tolist() == [3, 3]
    with F.no_grad():
        assert not F.is_recording()


def test_unknown_backend_and_function():
    with pytest.raises(BackendError, match="expected one of"):
        load_backend("mxnet")
    with pytest.raises(BackendError, match="not part of the F.\\* contract"):
        load_backend("numpy").conv2d


def test_env_var_chooses_backend(monkeypatch):
    monkeypatch.setenv("DISTEMB_BACKEND", "numpy")
    assert load_backend().name == "numpy"


def test_numpy_backend_and_package_import_never_import_torch():
    code = ("import sys, distemb, distemb.backend as b; b.load_backend('numpy'); "
            "import distemb.kvstore, distemb.partition, distemb.kernels; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
