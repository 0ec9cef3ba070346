"""numpy backend: servers and reference maths. Never imports torch; has no autograd."""
import numpy as np

NAME = "numpy"
_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
           "int32": np.int32, "int64": np.int64, "int8": np.int8, "uint8": np.uint8,
           "bool": np.bool_}


def dtype_name(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise TypeError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return name


def dtype(name):
    return np.dtype(_DTYPES[dtype_name(name)])


def tensor(data, dtype=None):
    return np.array(data, dtype=None if dtype is None else _DTYPES[dtype_name(dtype)])


def zeros(shape, dtype):
    return np.zeros(shape, dtype=_DTYPES[dtype_name(dtype)])


def empty(shape, dtype):
    return np.empty(shape, dtype=_DTYPES[dtype_name(dtype)])


def arange(start, stop, dtype="int64"):
    return np.arange(start, stop, dtype=_DTYPES[dtype_name(dtype)])


def shape(t):
    return tuple(t.shape)


def dtype_of(t):
    return dtype_name(t.dtype)


def ndim(t):
    return t.ndim


def to_numpy(t):
    return np.asarray(t)


def from_numpy(a):
    return np.asarray(a)


def is_tensor(x):
    return isinstance(x, np.ndarray)


def gather_row(t, idx):
    return t[idx]


def scatter_row_inplace(t, idx, v):
    t[idx] = v


def index_add_inplace(t, idx, v):
    np.add.at(t, idx, v)


def unique(t, return_inverse=False):
    return np.unique(t, return_inverse=return_inverse)


def cat(seq, dim=0):
    return np.concatenate(seq, axis=dim)


def reshape(t, shape):
    return t.reshape(shape)


def astype(t, dtype):
    return t.astype(_DTYPES[dtype_name(dtype)], copy=False)


def device_of(t):
    return "cpu"


def copy_to(t, device):
    if str(device) != "cpu":
        raise ValueError(f"device: the numpy backend has only 'cpu', got {device!r}")
    return t
