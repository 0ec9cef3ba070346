"""Shared fixtures: every test gets its own embedded context (no shared tables)."""
import os

import numpy as np
import pytest

os.environ.setdefault("DGLBACKEND", "pytorch")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


@pytest.fixture
def ctx():
    """A fresh embedded DistContext with the pytorch backend, closed afterwards."""
    from distemb.context import DistContext

    c = DistContext.embedded(backend="pytorch", num_threads=2)
    yield c
    c.close()


def zipf_ids(rng, num_rows, size, a=1.2):
    """Duplicate-heavy ids: zipf ranks scattered over the table by a fixed permutation."""
    ranks = (rng.zipf(a, size) - 1) % num_rows
    perm = np.random.default_rng(12345).permutation(num_rows)
    return perm[ranks].astype(np.int64)
