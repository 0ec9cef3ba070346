"""Backends of the F.* contract (see :mod:`distemb.backend.contract`).

A backend is chosen once and explicitly: ``load_backend(name)``, where ``name`` defaults
to the ``DISTEMB_BACKEND`` environment variable, else ``'pytorch'``. Importing this
package loads nothing; the numpy backend never imports torch. Asking a backend for a
function it lacks raises :class:`~distemb.errors.BackendError` naming both.

Example:
    >>> import numpy as np
    >>> F = load_backend("numpy")
    >>> F.reshape(F.from_numpy(np.arange(6, dtype="float32")), (2, 3)).shape
    (2, 3)
"""
import importlib
import os

from distemb.backend.contract import FUNCTIONS
from distemb.errors import BackendError

BACKENDS = ("pytorch", "numpy")


class Backend:
    """One loaded backend: attribute access is limited to the F.* contract."""

    def __init__(self, module):
        self._module = module
        self.name = module.NAME

    def __getattr__(self, fn):
        if fn.startswith("_"):
            raise AttributeError(fn)
        if fn not in FUNCTIONS:
            raise BackendError(f"'{fn}' is not part of the F.* contract "
                               f"(see distemb/backend/contract.py)")
        try:
            value = getattr(self._module, fn)
        except AttributeError:
            raise BackendError(f"backend '{self.name}' does not implement '{fn}'") from None
        # Cached on the instance: the next F.fn is a plain attribute (on the hot path of
        # every lookup and step), and __getattr__ runs only for names not yet checked.
        setattr(self, fn, value)
        return value

    def has(self, fn):
        """Whether this backend implements contract function ``fn``."""
        return hasattr(self._module, fn)

    def __repr__(self):
        return f"Backend({self.name!r})"


def load_backend(name=None):
    """Load the backend ``name`` (default: $DISTEMB_BACKEND, else 'pytorch').

    Raises:
        BackendError: the name is not one of :data:`BACKENDS`, or its library is missing.
    """
    name = name or os.environ.get("DISTEMB_BACKEND") or "pytorch"
    if name not in BACKENDS:
        raise BackendError(f"backend: expected one of {list(BACKENDS)}, got {name!r}")
    try:
        module = importlib.import_module(f"distemb.backend.{name}")
    except ImportError as e:
        raise BackendError(f"backend '{name}' could not be loaded: {e}") from e
    return Backend(module)
