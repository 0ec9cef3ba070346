"""The CUDA segment-sum and checked-gather kernels, run on the CPU thread by thread.

tests/cuda_host/emulate_dedup.cpp compiles csrc/cuda/dedup_kernels.cuh (the kernels that
plan the chunks, sum them and combine them) as plain C++ and runs every thread of every
launch in turn, with the standard library in place of CUB's sort, run-length encoding
and scans. Without a GPU this is the test of the kernels' own indexing: the result must
equal the CPU twin (tests/cpu_cuda_twin.py) bit for bit, unused slots must hold what
dedup_sum_padded promises, and nothing may be written past the unique rows. It does not
test the CUDA compiler, CUB or the hardware: tests/test_cuda_segment_sum.py does, on a GPU.
tests/cuda_host/emulate_gather.cpp does the same for the checked gather (its three atomics
become plain updates), against the twin's ``gather_rows_checked``.
"""
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpu_cuda_twin import CpuCudaTwin, chunked_dedup_sum
from distemb.kernels import cuda
from test_cuda_segment_sum import boundary_cases, zipf_batch
from tests.test_cuda_kernels import ROOT

CXX = shutil.which("g++") or shutil.which("c++")
UNTOUCHED = np.float32(-777.0)  # what the harness fills the sums with before the kernels


def build(tmp_path_factory, name):
    if CXX is None:
        pytest.skip("no C++ compiler (g++) to build the kernel emulation")
    exe = tmp_path_factory.mktemp("emu") / name
    # csrc/gen/ (the rule list the half emulation includes), as setup.py writes it
    subprocess.run([sys.executable, f"{ROOT}/csrc/codegen.py"], check=True, timeout=60,
                   stdout=subprocess.DEVNULL)
    subprocess.run([CXX, "-O2", "-std=c++17", "-Wall", "-Wno-unknown-pragmas", "-o", str(exe),
                    f"{ROOT}/tests/cuda_host/{name}.cpp"], check=True, timeout=300)
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "emulate_dedup")


@pytest.fixture(scope="module")
def gather_emulator(tmp_path_factory):
    return build(tmp_path_factory, "emulate_gather")


def run(emulator, tmp_path, ids, grads, num_rows=None):
    """(num_unique, uniq slots, sums) from the emulated kernels."""
    n, d = grads.shape
    end_bit = 64 if num_rows is None else max(1, min(64, int(num_rows).bit_length()))
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        np.array([n, d, num_rows or 0, end_bit], np.int64).tofile(f)
        ids.astype(np.int64).tofile(f)
        grads.astype(np.float32).tofile(f)
    subprocess.run([str(emulator), str(src), str(dst)], check=True, timeout=300)
    raw = dst.read_bytes()
    u = int(np.frombuffer(raw[:8], np.int64)[0])
    uniq = np.frombuffer(raw[8:8 + 8 * n], np.int64)
    summed = np.frombuffer(raw[8 + 8 * n:], np.float32).reshape(n, d)
    return u, uniq, summed


def check(emulator, tmp_path, ids, grads, num_rows=None):
    u, uniq, summed = run(emulator, tmp_path, ids, grads, num_rows)
    want_uniq, want = chunked_dedup_sum(ids, grads, num_rows=num_rows)
    assert u == want_uniq.shape[0]
    np.testing.assert_array_equal(uniq[:u], want_uniq)
    if num_rows is not None:
        assert (uniq[u:] == num_rows).all()  # dedup_sum_padded's promise
    assert np.array_equal(summed[:u].view(np.int32), want.view(np.int32)), \
        f"{np.count_nonzero(summed[:u] != want)} of {want.size} sums differ from the twin's"
    assert (summed[u:] == UNTOUCHED).all(), "a kernel wrote past the unique rows"


@pytest.mark.parametrize("name", sorted(boundary_cases()))
@pytest.mark.parametrize("num_rows", [None, 64], ids=["all_bits", "table_bits"])
def test_kernels_equal_twin_at_chunk_boundaries(emulator, tmp_path, name, num_rows):
    ids, grads = boundary_cases()[name]
    check(emulator, tmp_path, ids, grads, num_rows)


@pytest.mark.parametrize("dim", [1, 7, 33, 128])
def test_kernels_equal_twin_on_zipf_65536(emulator, tmp_path, dim):
    ids, grads = zipf_batch(dim, dim=dim)
    assert np.bincount(ids).max() > 5_000
    check(emulator, tmp_path, ids, grads, num_rows=1_000_000)


def test_bad_ids_are_summed_apart_and_never_alias(emulator, tmp_path):
    rng = np.random.default_rng(5)
    ids = rng.integers(-50, 1100, size=5_000).astype(np.int64)
    ids[:40] = 1023 + 2048  # same low 11 bits as the valid id 1023
    grads = rng.standard_normal((5_000, 5)).astype(np.float32)
    check(emulator, tmp_path, ids, grads, num_rows=1024)
    check(emulator, tmp_path, ids, grads, num_rows=None)  # all 64 bits, signed order


def test_the_comparison_can_fail(emulator, tmp_path):
    """A twin with another chunk size disagrees with the kernels: the test has teeth."""
    ids, grads = boundary_cases()["one-id"]
    u, _, summed = run(emulator, tmp_path, ids, grads)
    other = chunked_dedup_sum(ids, grads, chunk=16)[1]
    assert u == 1 and not np.array_equal(summed[:1], other)


@pytest.mark.parametrize("dim", [1, 3, 64])
def test_checked_gather_equals_twin(gather_emulator, tmp_path, dim):
    rng = np.random.default_rng(dim)
    table = rng.standard_normal((50, dim)).astype(np.float32)
    ids = rng.integers(-10, 60, size=300).astype(np.int64)
    flags = np.array(cuda.CLEAN_ID_FLAGS, np.int64)
    flags[0], flags[1] = 2, -40  # carried over from earlier lookups: accumulated into
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(src, "wb") as f:
        np.array([50, dim, ids.shape[0]], np.int64).tofile(f)
        flags.tofile(f)
        table.tofile(f)
        ids.tofile(f)
    subprocess.run([str(gather_emulator), str(src), str(dst)], check=True, timeout=300)
    raw = dst.read_bytes()
    got_flags = np.frombuffer(raw[:24], np.int64)
    rows = np.frombuffer(raw[24:], np.float32).reshape(-1, dim)
    want_flags = torch.from_numpy(flags.copy())
    want = CpuCudaTwin().gather_rows_checked(torch.from_numpy(table), torch.from_numpy(ids),
                                             want_flags)
    bad = (ids < 0) | (ids >= 50)
    assert bad.sum() > 10 and got_flags.tolist() == want_flags.tolist()
    assert got_flags.tolist() == [2 + bad.sum(), -40, ids[bad].max()]
    np.testing.assert_array_equal(rows, want.numpy())
