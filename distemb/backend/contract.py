"""The F.* contract: every function a backend must provide, with its meaning.

A backend is a module that defines these names. Tensors are the backend's own type
(``torch.Tensor`` or ``numpy.ndarray``); ``to_numpy``/``from_numpy`` cross between a
backend and the numpy world of servers and kernels without copying where possible.
The contract holds exactly the functions distemb calls outside ``distemb/backend``
(tests/test_backend.py checks that each one has a caller): add a function when code
needs it, not before.

Creation and type
    dtype(name) -> backend dtype for 'float32', 'int64', ...
    dtype_name(dtype) -> canonical name ('float32'); accepts backend, numpy or str dtypes
    dtype_of(t) -> canonical dtype name of tensor t
    to_numpy(t) -> numpy array (zero copy for CPU tensors)
    from_numpy(a) -> tensor (zero copy)
    is_tensor(x) -> bool
    reshape(t, shape) -> t with a new shape
Devices
    copy_to(t, device) -> t on device (no copy if already there)
Autograd (trainer backends only; the numpy backend raises BackendError)
    is_recording() -> bool: would an operation now be recorded for backward?
    attach_grad(t) -> t marked as requiring a gradient (a leaf)
    grad(t) -> the gradient accumulated on t, or None
"""

FUNCTIONS = (
    "dtype", "dtype_name", "dtype_of", "to_numpy", "from_numpy", "is_tensor",
    "reshape", "copy_to", "is_recording", "attach_grad", "grad",
)

AUTOGRAD_FUNCTIONS = ("is_recording", "attach_grad", "grad")
