"""The builds of the compiled float32 kernels (csrc/cpu_kernels.h: baseline x86-64, AVX2 +
FMA + F16C, AVX-512; picked at import) give the same bits for every rule, the gather and
dedup, and the choice can be overridden: ``kernels.cpu_isa()`` for a block,
``DISTEMB_CPU_ISA`` for a process, refused for a build this CPU lacks.
(tests/test_half_isa.py does the same for the half kernels; tests/conftest.py's
``kernel_impl`` runs the torch and numpy oracles of the kernels under every build; the
model-level oracles, ``model_impl``, run one build, which these tests make enough.)"""
import os
import subprocess
import sys

import numpy as np
import pytest

from distemb import kernels

pytestmark = pytest.mark.skipif(not kernels.HAS_EXT, reason="compiled kernels not loaded "
                                "(DISTEMB_NO_EXT=1 or not built): nothing to compare")


VECTOR_ISAS = [n for n in kernels.ALL_CPU_ISAS if n != "baseline"]


def _need(isa):
    if isa not in kernels.available_cpu_isas():
        pytest.skip(f"this CPU lacks the {isa} build's instructions: it runs "
                    f"{kernels.available_cpu_isas()}")


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
        elif op == "gather":
            return [kernels.gather_rows(w, np.concatenate([ids, ids[:7]]), num_threads=2)]
        elif op == "dedup":
            dup = np.concatenate([ids, ids[::3], ids[:5]])
            grads = rng.standard_normal((dup.size, d)).astype(np.float32)
            return list(kernels.dedup_sum(dup, grads, num_threads=2))
        else:
            kernels.ftrl_update(w, a, b, ids, g, 0.05, float(op.split("@")[1]), 0.01, 0.02,
                                0.03, 0.1)
    assert not np.array_equal(w, w0), "nothing was updated: the comparison would be void"
    return [w, a, b, a1, steps]


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("d", [1, 7, 133])  # 133: the vector loops' tails too
@pytest.mark.parametrize("op", ["sgd", "adagrad", "rowwise", "adam", "adam-per-row",
                                "ftrl@-0.5", "ftrl@0.0", "ftrl@-0.3", "gather", "dedup"])
def test_every_build_gives_the_baseline_bits(op, d, isa, monkeypatch):
    _need(isa)
    monkeypatch.setattr(kernels, "MIN_FLOATS_PER_THREAD", 1)  # two threads, even here
    with kernels.implementation("compiled"):
        base, vec = _run(op, "baseline", d), _run(op, isa, d)
    for x, y in zip(base, vec):
        assert x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("lr_power", [-0.5, -0.3])
def test_every_build_gives_the_baseline_half_ftrl(kind, lr_power, isa):
    _need(isa)
    from distemb import _halfkernels as hk
    rng = np.random.default_rng(kind)
    rows, d = 400, 133
    vals = rng.standard_normal((rows, d)).astype(np.float32)
    ids = rng.permutation(rows)[:150].astype(np.int64)
    g = rng.standard_normal((150, d)).astype(np.float32)
    outs = []
    for number in (0, kernels.CPU_ISAS[isa]):
        bits = np.empty(rows * d, np.uint16)
        hk.encode(min(kind, 1), vals.reshape(-1), bits, isa=number)
        w = bits.reshape(rows, d)
        n, z = np.abs(vals) + np.float32(0.1), vals[::-1].copy()
        hk.ftrl_update(kind, w, n, z, ids, g, 0.05, lr_power, 0.3, 0.02, 0.03, 0.1, seed=3,
                       isa=number)
        outs.append([w.copy(), n, z])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_the_block_override_restores_and_rejects_unknown_builds():
    before = kernels.current_cpu_isa()
    assert kernels.ISA == before == kernels.available_cpu_isas()[-1]  # the best, by default
    with kernels.cpu_isa("baseline"):
        assert kernels.current_cpu_isa() == kernels.ISA == "baseline"
    assert kernels.current_cpu_isa() == kernels.ISA == before
    with pytest.raises(ValueError, match="isa: expected one of"):
        with kernels.cpu_isa("avx9000"):
            pass
    assert kernels.ISA == before


def test_the_environment_picks_the_build_of_a_process():
    code = "from distemb import kernels; print(kernels.ISA, kernels.current_cpu_isa())"
    have = kernels.available_cpu_isas()
    for name in have + ("best",):
        env = dict(os.environ, DISTEMB_CPU_ISA=name)
        got = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout.split()
        want = have[-1] if name == "best" else name
        assert got == [want, want], name


def test_a_build_this_cpu_lacks_is_refused():
    lacking = [n for n in kernels.ALL_CPU_ISAS if n not in kernels.available_cpu_isas()]
    if not lacking:
        pytest.skip(f"this CPU runs every build {kernels.ALL_CPU_ISAS}: none to refuse")
    with pytest.raises(ValueError, match=f"isa: '{lacking[-1]}' is not available here"):
        with kernels.cpu_isa(lacking[-1]):
            pass
    env = dict(os.environ, DISTEMB_CPU_ISA=lacking[-1])
    proc = subprocess.run([sys.executable, "-c", "import distemb.kernels"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "is not available here" in proc.stderr


def test_a_build_from_older_sources_is_refused_with_the_fix():
    """An extension built before the ISA builds (no isa_supported) must not be half-used."""
    code = ("import sys, types; sys.modules['distemb._kernels'] = "
            "types.ModuleType('distemb._kernels'); import distemb.kernels")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, DISTEMB_NO_EXT="0"))
    assert proc.returncode != 0
    assert "was built from older sources" in proc.stderr and "rebuild" in proc.stderr
