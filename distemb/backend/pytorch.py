"""PyTorch backend: trainers, autograd, devices."""

import numpy as np
import torch

NAME = "pytorch"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16,
           "int32": torch.int32, "int64": torch.int64, "int8": torch.int8,
           "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _DTYPES:
        raise TypeError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return name


def dtype(name):
    return _DTYPES[dtype_name(name)]


def dtype_of(t):
    return dtype_name(t.dtype)


def to_numpy(t):
    if isinstance(t, np.ndarray):
        return t
    if type(t) is torch.Tensor and t.is_cpu and not t.requires_grad and \
            t.dtype is not torch.bfloat16:
        return t.numpy()  # the usual case (ids, gradients): shared, no dispatch to detach
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: as float32, exactly
            t = t.float()
        return t.detach().cpu().numpy()
    return np.asarray(t)


def from_numpy(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def is_tensor(x):
    return isinstance(x, torch.Tensor)


def reshape(t, shape):
    return t.reshape(shape)


def copy_to(t, device):
    return t.to(device, non_blocking=True)


def is_recording():
    return torch.is_grad_enabled()


def attach_grad(t):
    return t.requires_grad_()


def grad(t):
    return t.grad
