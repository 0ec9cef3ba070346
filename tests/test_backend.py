"""One conformance suite for every backend of the F.* contract."""
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import distemb
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
    assert F.dtype_name(np.int32) == "int32" and F.dtype_name("float32") == "float32"
    with pytest.raises(TypeError, match="dtype: expected one of"):
        F.dtype_name("complex128")
    t = F.from_numpy(np.array([[1, 2], [3, 4]], "float32"))
    assert F.is_tensor(t) and not F.is_tensor([1])
    assert F.dtype_of(t) == "float32" and F.dtype_of(F.from_numpy(np.array([1]))) == "int64"
    assert F.dtype(F.dtype_name("int64")) == F.dtype("int64")


def test_numpy_roundtrip_is_zero_copy(F):
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    t = F.from_numpy(a)
    a[0, 0] = 42
    assert F.to_numpy(t)[0, 0] == 42


def test_reshape_and_copy_to(F):
    t = F.from_numpy(np.arange(8, dtype=np.float32).reshape(4, 2))
    assert F.to_numpy(F.reshape(t, (8,))).tolist() == list(range(8))
    assert F.to_numpy(F.copy_to(t, "cpu")).tolist() == F.to_numpy(t).tolist()


def test_autograd_functions_on_pytorch():
    import torch

    F = load_backend("pytorch")
    t = F.attach_grad(torch.zeros(2))
    assert F.is_recording()
    (t * 3).sum().backward()
    assert F.grad(t).tolist() == [3, 3]
    with torch.no_grad():
        assert not F.is_recording()


def test_contract_is_what_distemb_calls():
    """Every F.* function has a caller outside distemb/backend; every call is declared."""
    root = pathlib.Path(distemb.__file__).parent
    called = set()
    for path in root.rglob("*.py"):
        if path.parent.name != "backend":
            called |= set(re.findall(r"\b_?F\.([a-z_]+)\(", path.read_text()))
    assert called - set(FUNCTIONS) == set(), "calls outside the F.* contract"
    assert set(FUNCTIONS) - called == set(), "contract functions nobody calls: remove them"


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


def test_server_process_imports_neither_torch_nor_the_context():
    """``python -m distemb.server`` loads only what a server needs (python -X importtime)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "distemb.server", "--help"],
                         capture_output=True, text=True, check=True, timeout=120).stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.splitlines()}
    assert "distemb.kvstore.server.service" in imported  # the check sees the server's imports
    assert "distemb.context" not in imported and "torch" not in imported
