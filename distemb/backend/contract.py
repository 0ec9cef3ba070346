"""The F.* contract: every function a backend must provide, with its meaning.

A backend is a module that defines these names. Tensors are the backend's own type
(``torch.Tensor`` or ``numpy.ndarray``); ``to_numpy``/``from_numpy`` cross between a
backend and the numpy world of servers and kernels without copying where possible.

Creation and type
    dtype(name) -> backend dtype for 'float32', 'int64', ...
    dtype_name(dtype) -> canonical name ('float32'); accepts backend, numpy or str dtypes
    tensor(data, dtype=None) -> new tensor from a list/array
    zeros(shape, dtype), empty(shape, dtype), arange(start, stop, dtype='int64')
    shape(t) -> tuple; dtype_of(t) -> canonical dtype name; ndim(t)
    to_numpy(t) -> numpy array (zero copy for CPU tensors)
    from_numpy(a) -> tensor (zero copy)
    is_tensor(x) -> bool
Rows
    gather_row(t, idx) -> t[idx]
    scatter_row_inplace(t, idx, v) -> t[idx] = v
    index_add_inplace(t, idx, v) -> t[idx] += v, duplicates accumulated
    unique(t, return_inverse=False) -> sorted unique values (and inverse indices)
    cat(seq, dim=0), reshape(t, shape), astype(t, dtype)
Devices
    device_of(t) -> device string ('cpu', 'cuda:0')
    copy_to(t, device) -> t on device (no copy if already there)
Autograd (trainer backends only; the numpy backend raises BackendError)
    is_recording() -> bool: would an operation now be recorded for backward?
    attach_grad(t) -> t marked as requiring a gradient (a leaf)
    grad(t) -> the gradient accumulated on t, or None
    no_grad() -> context manager that stops recording
"""

FUNCTIONS = (
    "dtype", "dtype_name", "tensor", "zeros", "empty", "arange", "shape", "dtype_of",
    "ndim", "to_numpy", "from_numpy", "is_tensor", "gather_row", "scatter_row_inplace",
    "index_add_inplace", "unique", "cat", "reshape", "astype", "device_of", "copy_to",
    "is_recording", "attach_grad", "grad", "no_grad",
)

AUTOGRAD_FUNCTIONS = ("is_recording", "attach_grad", "grad", "no_grad")
