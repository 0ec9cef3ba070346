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


def dtype_of(t):
    return dtype_name(t.dtype)


def to_numpy(t):
    return np.asarray(t)


def from_numpy(a):
    return np.asarray(a)


def is_tensor(x):
    return isinstance(x, np.ndarray)


def reshape(t, shape):
    return t.reshape(shape)


def copy_to(t, device):
    if str(device) != "cpu":
        raise ValueError(f"device: the numpy backend has only 'cpu', got {device!r}")
    return t
