"""Every element-wise rule of the one table (distemb/kernels/rule_table.py) is in every build.

The table is the only place that lists the element-wise rules: csrc/codegen.py makes the
compiled entry points from it and distemb.kernels makes the Python wrappers. These tests
check the builds, not the table: each compiled module, the CUDA C API's declarations (and
the built library when there is one), the CPU emulation of the CUDA kernels and the
kernel contract expose every rule, and each build's entry point runs that rule's
arithmetic (equal, bit for bit, to the numpy twin written separately from the formula).
A rule added to the table but missing from any build fails here.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from cpu_cuda_twin import CpuCudaHalfTwin, CpuCudaTwin
from distemb import kernels
from distemb.kernels import cuda_lib, half, ops, reference, reference_half, rule_table
from distemb.kernels.cuda_half import CudaHalfOps
from test_cuda_emulated import build
from test_cuda_half_emulated import emulate
from tests.test_cuda_kernels import ROOT

RULES = [r.name for r in rule_table.RULES]
# A value for every hyperparameter name the table uses; a new name gets 0.1.
HYPER = {"lr": 0.05, "clr": 0.05, "eps": 1e-3, "lr_power": -0.5, "l1": 0.01, "l2": 0.02,
         "l2_shrinkage": 0.03, "beta": 0.1}


def hyper_of(rule):
    return [HYPER.get(h, 0.1) for h in rule.hyper_names]


def case(rule, d=7, num_rows=50, seed=0):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((num_rows, d)).astype(np.float32)
    states = [rng.random((num_rows, d)).astype(np.float32) + 0.1 for _ in rule.states]
    rows = rng.permutation(num_rows)[:23].astype(np.int64)
    grads = rng.standard_normal((23, d)).astype(np.float32)
    return weight, states, rows, grads


def same_bits(x, y):
    return np.array_equal(np.ascontiguousarray(x).view(np.uint8),
                          np.ascontiguousarray(y).view(np.uint8))


def missing_kernels(impls, table=rule_table.RULES):
    """(implementation, kernel) pairs where a table rule's kernel is absent."""
    return [(name, r.kernel) for name, impl in impls.items() for r in table
            if not callable(getattr(impl, r.kernel, None))]


def test_the_contract_declares_every_rule():
    for r in rule_table.RULES:
        assert r.kernel in ops.KERNEL_NAMES
        assert callable(getattr(ops.KernelOps, r.kernel))
    impls = {"kernels": kernels, "reference": reference, "half": half,
             "reference_half": reference_half, "stochastic": half.StochasticRounding(),
             "cuda_half": CudaHalfOps(), "cpu_cuda_twin": CpuCudaTwin(),
             "cpu_cuda_half_twin": CpuCudaHalfTwin()}
    assert missing_kernels(impls) == []


def test_a_rule_missing_from_a_build_is_caught():
    """The check can fail: a table with one more rule than the builds were made from."""
    extra = rule_table.ElementwiseRule(name="nadam", struct="Nadam", states=("m",),
                                       hyper=(("lr", "float"),), summary="not built")
    assert missing_kernels({"reference": reference}, rule_table.RULES + (extra,)) == [
        ("reference", "nadam_update")]


@pytest.mark.parametrize("name", RULES)
def test_compiled_float32_build_runs_the_rule(name):
    if not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT=1): the reference run of "
                    "the other tests covers the twins")
    from distemb import _kernels

    rule = rule_table.rule_named(name)
    weight, states, rows, grads = case(rule)
    want_w, want_s = weight.copy(), [s.copy() for s in states]
    getattr(reference, rule.kernel)(want_w, *want_s, rows, grads, *hyper_of(rule))
    getattr(_kernels, rule.kernel)(weight, *states, rows, grads, *hyper_of(rule))
    assert not same_bits(weight, case(rule)[0]), "nothing was updated: the test would be void"
    assert same_bits(weight, want_w)
    for got, want in zip(states, want_s):
        assert same_bits(got, want)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "bfloat16-stochastic"])
@pytest.mark.parametrize("name", RULES)
def test_compiled_half_build_runs_the_rule(name, kind):
    if not kernels.HAS_EXT:
        pytest.skip("compiled kernels not loaded (DISTEMB_NO_EXT=1)")
    from distemb import _halfkernels

    rule = rule_table.rule_named(name)
    weight, states, rows, grads = case(rule, d=9)
    code = {"bfloat16": 0, "float16": 1, "bfloat16-stochastic": 2}[kind]
    bits = half.encode(weight, "float16" if kind == "float16" else "bfloat16").view(np.uint16)
    want_bits, want_s = bits.copy(), [s.copy() for s in states]
    getattr(reference_half, rule.kernel)(code, want_bits, *want_s, rows, grads,
                                         *hyper_of(rule), seed=77)
    for isa in (kernels.CPU_ISAS[n] for n in kernels.available_cpu_isas()):
        got_bits, got_s = bits.copy(), [s.copy() for s in states]
        getattr(_halfkernels, rule.kernel)(code, got_bits, *got_s, rows, grads,
                                           *hyper_of(rule), seed=77, isa=isa)
        assert not same_bits(got_bits, bits), "nothing was updated: the test would be void"
        assert same_bits(got_bits, want_bits), f"isa {isa}"
        for got, want in zip(got_s, want_s):
            assert same_bits(got, want), f"isa {isa}"


def generated(out_dir):
    """The files csrc/codegen.py makes from the table (as setup.py does), in ``out_dir``."""
    sys.path.insert(0, os.path.join(ROOT, "csrc"))
    try:
        import codegen
    finally:
        sys.path.pop(0)
    return {os.path.basename(p): open(p).read() for p in codegen.generate(str(out_dir))}


def _declarations(gen_header):
    """{C API function: number of parameters} declared by csrc/cuda/distemb_cuda.h and the
    generated header it includes."""
    with open(os.path.join(ROOT, "csrc", "cuda", "distemb_cuda.h")) as f:
        text = f.read()
    assert '#include "../gen/cuda_rules.h"' in text
    return {m.group(1): len(m.group(2).split(","))
            for m in re.finditer(r"DISTEMB_API int (distemb_cuda_\w+)\(([^)]*)\);",
                                 text + gen_header)}


def test_cuda_c_api_declares_every_rule_as_ctypes_calls_it(tmp_path):
    declared = _declarations(generated(tmp_path)["cuda_rules.h"])
    for r in rule_table.RULES:
        for symbol in (f"distemb_cuda_{r.kernel}", f"distemb_cuda_half_{r.kernel}"):
            assert symbol in declared, f"{symbol} is not declared in the C API"
            _, argtypes = cuda_lib._SIGNATURES[symbol]
            assert declared[symbol] == len(argtypes), symbol
    assert "distemb_cuda_nadam_update" not in declared  # the check can fail


def test_built_cuda_library_exports_every_rule():
    """When the CUDA library is built (nvcc present; it loads without a GPU), it has every
    rule's entry points and refuses bad sizes in each, so each is really compiled in."""
    if not os.path.exists(cuda_lib.CUDA_LIB_PATH):
        pytest.skip(f"{cuda_lib.CUDA_LIB_PATH} not built (no nvcc, or DISTEMB_NO_CUDA=1)")
    lib = cuda_lib.load_library()
    for r in rule_table.RULES:
        fn = getattr(lib, f"distemb_cuda_{r.kernel}")
        args = [None] * (1 + len(r.states)) + [10, 0, None, None, 1] + [1.0] * len(r.hyper)
        assert fn(*args, 0, None) == 1  # d = 0: cudaErrorInvalidValue, before any device
        fn = getattr(lib, f"distemb_cuda_half_{r.kernel}")
        args = [None, 0, 0] + [None] * len(r.states) + [10, 0, None, None, 1] + \
            [1.0] * len(r.hyper)
        assert fn(*args, 0, None) == 1


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "emulate_half")


def test_emulation_runs_every_rule_of_the_table(emulator):
    listed = subprocess.run([str(emulator), "--rules"], check=True, capture_output=True,
                            text=True, timeout=60).stdout.split()
    assert listed == RULES


@pytest.mark.parametrize("name", RULES)
def test_emulated_cuda_kernel_runs_the_rule(emulator, tmp_path, kernel_impl, name):
    """Op 100 + k of the emulation: the table's k-th rule through half_kernels.cuh, as
    the CPU half kernel (the twin under DISTEMB_NO_EXT), bit for bit."""
    rule = rule_table.rule_named(name)
    if len(rule.states) > 2 or len(rule.hyper) > 6:
        pytest.fail(f"{name}: the emulation's input format carries 2 states and 6 "
                    "hyperparameters; extend tests/cuda_host/emulate_half.cpp")
    weight, states, rows, grads = case(rule, d=9)
    w16 = half.encode(weight, "bfloat16")
    h = hyper_of(rule) + [0.0] * (6 - len(rule.hyper))
    a = states[0] if states else np.zeros_like(weight)
    b = states[1] if len(states) > 1 else np.zeros_like(weight)
    import test_cuda_half_emulated as emu

    emu.OPS[f"rule-{name}"] = 100 + RULES.index(name)
    try:
        got = emulate(emulator, tmp_path, f"rule-{name}", "bfloat16",
                      w16.view(np.uint16).copy(), rows, grads, a.copy(), b.copy(), None,
                      lr=h[0], ftrl=tuple(h[1:6]))
    finally:
        del emu.OPS[f"rule-{name}"]
    getattr(half, "seeded_" + rule.kernel)(w16, *states, rows, grads, *hyper_of(rule))
    assert same_bits(got["bits"].reshape(weight.shape), w16.view(np.uint16))
    for k, s in enumerate(states):
        assert same_bits(got["ab"[k]].reshape(weight.shape), s)


def test_generated_sources_hold_every_rule(tmp_path):
    """Each rule's entry points are in what csrc/codegen.py makes, for every build."""
    files = generated(tmp_path)
    for r in rule_table.RULES:
        for fname, name in (("cpu_rules.h", f"{r.name}_f32("), ("cpu_rules.h", f"{r.name}("),
                            ("kernels_rules.pxi", f"def {r.kernel}("),
                            ("halfkernels_rules.pxi", f"def {r.kernel}("),
                            ("cuda_optim_rules.inc", f"distemb_cuda_{r.kernel}("),
                            ("cuda_half_rules.inc", f"distemb_cuda_half_{r.kernel}("),
                            ("rule_list.h", f"X({r.name}, {r.struct})")):
            assert name in files[fname], (fname, name)
