"""The two builds of the compiled float32 updates (csrc/cpu_kernels.h, the baseline x86-64
build and the AVX2 one, picked at import) give the same bits for every rule, and the
choice can be overridden: ``kernels.cpu_isa()`` for a block, ``DISTEMB_CPU_ISA`` for a
process. (tests/test_half_isa.py does the same for the half kernels.)"""
import os
import subprocess
import sys

import numpy as np
import pytest

from distemb import kernels

pytestmark = pytest.mark.skipif(not kernels.HAS_EXT, reason="compiled kernels not loaded "
                                "(DISTEMB_NO_EXT=1 or not built): nothing to compare")


def _need_vector():
    if "avx2" not in kernels.available_cpu_isas():
        pytest.skip("this CPU lacks AVX2 or F16C: only the baseline build runs here")


def _run(op, isa, d):
    rng = np.random.default_rng(d)
    rows = 400
    w = (rng.standard_normal((rows, d)) * np.exp(rng.uniform(-20, 12, (rows, 1)))
         ).astype(np.float32)
    ids = rng.permutation(rows)[:150].astype(np.int64)
    g = rng.standard_normal((150, d)).astype(np.float32)
    a, b = np.abs(w) + np.float32(1e-3), w[::-1].copy()
    a1 = np.abs(w[:, 0]).copy()
    steps = rng.integers(0, 5, rows).astype(np.int64)
    w0 = w.copy()
    with kernels.cpu_isa(isa):
        assert kernels.current_cpu_isa() == isa
        if op == "sgd":
            kernels.sgd_update(w, ids, g, 0.1)
        elif op == "adagrad":
            kernels.adagrad_update(w, a, ids, g, 0.1, 1e-3)
        elif op == "rowwise":
            kernels.rowwise_adagrad_update(w, a1, ids, g, 0.1, 1e-3)
        elif op == "adam":
            kernels.adam_update(w, b, a, ids, g, 0.01, 0.9, 0.99, 1e-8, 2)
        elif op == "adam-per-row":
            kernels.adam_update(w, b, a, ids, g, 0.01, 0.9, 0.99, 1e-8, 0, row_steps=steps)
        else:
            kernels.ftrl_update(w, a, b, ids, g, 0.05, float(op.split("@")[1]), 0.01, 0.02,
                                0.03, 0.1)
    assert not np.array_equal(w, w0), "nothing was updated: the comparison would be void"
    return [w, a, b, a1, steps]


@pytest.mark.parametrize("d", [1, 7, 133])  # 133: the vector loops' tails too
@pytest.mark.parametrize("op", ["sgd", "adagrad", "rowwise", "adam", "adam-per-row",
                                "ftrl@-0.5", "ftrl@0.0", "ftrl@-0.3"])
def test_baseline_and_avx2_float32_updates_agree(op, d):
    _need_vector()
    with kernels.implementation("compiled"):
        base, vec = _run(op, "baseline", d), _run(op, "avx2", d)
    for x, y in zip(base, vec):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("lr_power", [-0.5, -0.3])
def test_baseline_and_avx2_half_ftrl_agree(kind, lr_power):
    _need_vector()
    from distemb import _halfkernels as hk
    rng = np.random.default_rng(kind)
    rows, d = 400, 133
    vals = rng.standard_normal((rows, d)).astype(np.float32)
    ids = rng.permutation(rows)[:150].astype(np.int64)
    g = rng.standard_normal((150, d)).astype(np.float32)
    outs = []
    for isa in (0, 1):
        bits = np.empty(rows * d, np.uint16)
        hk.encode(min(kind, 1), vals.reshape(-1), bits, isa=isa)
        w = bits.reshape(rows, d)
        n, z = np.abs(vals) + np.float32(0.1), vals[::-1].copy()
        hk.ftrl_update(kind, w, n, z, ids, g, 0.05, lr_power, 0.3, 0.02, 0.03, 0.1, seed=3,
                       isa=isa)
        outs.append([w.copy(), n, z])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_block_override_restores_and_rejects_unknown_builds():
    before = kernels.current_cpu_isa()
    with kernels.cpu_isa("baseline"):
        assert kernels.current_cpu_isa() == "baseline"
    assert kernels.current_cpu_isa() == before
    with pytest.raises(ValueError, match="isa: expected one of"):
        with kernels.cpu_isa("avx9000"):
            pass


def test_the_environment_picks_the_build_of_a_process():
    _need_vector()
    code = "from distemb import kernels; print(kernels.current_cpu_isa())"
    got = {}
    for name in ("baseline", "avx2", "best"):
        env = dict(os.environ, DISTEMB_CPU_ISA=name)
        got[name] = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True, timeout=120).stdout.strip()
    assert got == {"baseline": "baseline", "avx2": "avx2", "best": "avx2"}
