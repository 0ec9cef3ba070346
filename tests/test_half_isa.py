"""The builds of the compiled half kernels (csrc/cpu_kernels.h): the baseline x86-64 build,
the AVX2 + FMA + F16C build and the AVX-512 build, picked at run time by the CPU, give
the same bits for every kernel, every format and both roundings (so which one a machine
picks changes nothing but speed)."""
import numpy as np
import pytest

from distemb import kernels

pytestmark = pytest.mark.skipif(not kernels.HAS_EXT, reason="compiled kernels not loaded "
                                "(DISTEMB_NO_EXT=1 or not built): nothing to compare")


def _builds(isa):
    from distemb import _halfkernels as hk
    if isa not in kernels.available_cpu_isas():
        pytest.skip(f"this CPU lacks the {isa} build's instructions: it runs "
                    f"{kernels.available_cpu_isas()}")
    return hk


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("op", ["encode", "gather", "sgd", "adagrad", "rowwise", "adam"])
def test_every_build_gives_the_baseline_bits(kind, op, isa):
    hk = _builds(isa)
    rng = np.random.default_rng(kind)
    rows, d = 400, 133  # not a multiple of 8 or 16: the vector loops' tails too
    vals = (rng.standard_normal((rows, d)) * np.exp(rng.uniform(-20, 12, (rows, 1)))
            ).astype(np.float32)
    ids = rng.permutation(rows)[:150].astype(np.int64)
    grads = rng.standard_normal((150, d)).astype(np.float32)
    outs = []
    for isa in (0, kernels.CPU_ISAS[isa]):
        bits = np.empty(rows * d, np.uint16)
        hk.encode(min(kind, 1), vals.reshape(-1), bits, isa=isa)
        w = bits.reshape(rows, d)
        s = np.abs(vals).astype(np.float32)
        m, v = vals.copy(), np.abs(vals).astype(np.float32)
        s1 = np.abs(vals[:, 0]).copy()
        out = np.zeros((150, d), np.float32)
        if op == "gather":
            hk.gather_rows(kind, w, ids, out, isa=isa)
        elif op == "sgd":
            hk.sgd_update(kind, w, ids, grads, 0.1, seed=3, isa=isa)
        elif op == "adagrad":
            hk.adagrad_update(kind, w, s, ids, grads, 0.1, 1e-3, seed=3, isa=isa)
        elif op == "rowwise":
            hk.rowwise_adagrad_update(kind, w, s1, ids, grads, 0.1, 1e-3, seed=3, isa=isa)
        elif op == "adam":
            hk.adam_update(kind, w, m, v, ids, grads, 0.01, 0.9, 0.99, 1e-8, 2, seed=3, isa=isa)
        back = np.empty(rows * d, np.float32)
        hk.decode(min(kind, 1), bits, back, isa=isa)
        outs.append([w.copy(), s, s1, m, v, out, back])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_an_unknown_build_is_refused():
    from distemb import _halfkernels as hk
    with pytest.raises(ValueError, match="isa: expected -1, 0, 1 or 2"):
        hk.encode(0, np.zeros(4, np.float32), np.zeros(4, np.uint16), isa=7)
