"""Dense tables land on 2 MiB pages even when their first touch got 4 KiB pages
(distemb/pages.py): what the kernel mapped is read back from /proc/self/smaps."""
import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from distemb.stores.dense import DenseStore
from distemb.pages import MIN_BYTES, back_with_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="transparent huge pages are a Linux feature")


#: Arrays of the tests: past glibc's mmap threshold as distemb sets it (32 MiB,
#: distemb.malloc), so each is a mapping of its own and smaps' per-mapping count is the
#: array's (a smaller one lives in the heap, whose count holds every other array's too).
ROWS = (48 << 20) // (64 * 4)


def mapped_bytes(array, field):
    """Bytes of smaps ``field`` (``Rss``, ``AnonHugePages``) over the mappings holding
    ``array``: the array's own, for arrays past the mmap threshold, which asking its
    2 MiB blocks for huge pages splits in up to three."""
    lo, hi = array.ctypes.data, array.ctypes.data + array.nbytes
    total, overlap = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                overlap = start < hi and end > lo
            elif head == field + ":" and overlap:
                total += int(line.split()[1]) * 1024
    return total


def huge_bytes(array):
    """Bytes of the mappings holding ``array`` that the kernel maps with huge pages."""
    return mapped_bytes(array, "AnonHugePages")


@pytest.fixture
def four_k_pages():
    """numpy's own request for huge pages off: new arrays start on 4 KiB pages."""
    previous = np.core.multiarray._set_madvise_hugepage(False)
    yield
    np.core.multiarray._set_madvise_hugepage(previous)


@pytest.fixture
def own_mapping():
    """An array of ROWS x 64 float32 (48 MiB) in an anonymous mapping of its own, on
    4 KiB pages: numpy's would come from the heap when earlier tests left that much of
    it free (glibc serves any size from free heap memory first), and smaps counts a
    whole heap's huge pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.munmap.restype = ctypes.c_void_p, ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    nbytes = ROWS * 64 * 4
    addr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    a = np.ctypeslib.as_array((ctypes.c_float * (ROWS * 64)).from_address(addr))
    yield a.reshape(ROWS, 64)
    del a
    libc.munmap(addr, nbytes)


def test_a_touched_array_moves_onto_huge_pages_unchanged(own_mapping):
    a = own_mapping
    a[:] = np.random.default_rng(0).random((ROWS, 64), dtype=np.float32)
    before, want = huge_bytes(a), a.copy()
    if not back_with_huge_pages(a):
        pytest.skip("this kernel refused MADV_COLLAPSE (Linux < 6.1, or THP disabled)")
    assert before < a.nbytes // 2, "the array was on huge pages already: a void test"
    assert huge_bytes(a) >= a.nbytes - 2 * (2 << 20)  # all but the partial ends
    assert np.array_equal(a, want)


def test_dense_store_columns_are_on_huge_pages(four_k_pages):
    rows = ROWS // 2  # 48 MiB columns of 128 floats
    store = DenseStore(rows, 128, init=lambda k: np.ones((len(k), 128), np.float32))
    store.add_column("state", (128,), "float32", fill=0.5)
    probe = np.ones(MIN_BYTES // 4, np.float32)
    if not back_with_huge_pages(probe):
        pytest.skip("this kernel refused MADV_COLLAPSE (Linux < 6.1, or THP disabled)")
    for name in ("weight", "state"):
        col = store.column(name)
        assert huge_bytes(col) >= col.nbytes - 2 * (2 << 20), name
    assert float(store.column("weight").sum()) == rows * 128
    assert float(store.column("state")[-1, -1]) == 0.5


def test_small_arrays_and_files_are_left_alone(tmp_path):
    a = np.zeros(MIN_BYTES // 8, np.float32)
    assert back_with_huge_pages(a) is False
    assert back_with_huge_pages([1.0, 2.0]) is False
    m = np.memmap(tmp_path / "t", dtype=np.float32, mode="w+", shape=(MIN_BYTES // 2,))
    view = np.ndarray((MIN_BYTES // 4, 2), np.float32, buffer=m)  # as shm arenas view theirs
    assert back_with_huge_pages(m) is False and back_with_huge_pages(view) is False


# --- shared memory: a server's shards and the trainers' read-only maps of them ----------

def mapping_of(address):
    """The smaps fields of this process's mapping holding ``address`` (kB values as ints,
    ``VmFlags`` as a set of flags)."""
    out, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = start <= address < end
            elif inside:
                key, rest = line.split(":", 1)
                out[key] = set(rest.split()) if key == "VmFlags" else int(rest.split()[0])
    return out


@pytest.fixture
def shard_and_view():
    """A 16 MiB shard in a server's arena (rows written) and a trainer's read-only map."""
    from distemb.transport.shm import ShmArena, attach
    arena = ShmArena("pages", 0)
    shape = (16 << 20) // (64 * 4), 64
    arr = arena.allocate(shape, "float32")
    arr[:] = 1.5
    view = attach(arena.dup_segment(arr), shape, "float32")
    yield arr, view
    del view
    arena.close()


def test_shards_and_their_maps_ask_for_huge_pages(shard_and_view):
    """Both ends ask (``hg``): which pages come is the machine's shmem_enabled."""
    arr, view = shard_and_view
    assert "hg" in mapping_of(arr.ctypes.data)["VmFlags"], "the server's shard map"
    assert "hg" in mapping_of(view.array.ctypes.data)["VmFlags"], "the trainer's map"


#: Set to 1 to let the test below write the machine's ``shmem_enabled`` (a kernel setting)
#: for its duration; a test run changes nothing on the machine unless asked.
MAY_SET_SHMEM = "DISTEMB_TEST_MAY_SET_SHMEM_ENABLED"


@pytest.fixture
def shmem_allows_huge_pages():
    """Shared memory may be on huge pages for the test: the machine's setting if it
    allows them; else, only when ``$DISTEMB_TEST_MAY_SET_SHMEM_ENABLED=1`` (root),
    ``advise`` for the test's duration, restored after."""
    from distemb.pages import SHMEM_ENABLED, shmem_setting
    before = shmem_setting()
    if before in ("advise", "within_size", "always", "force"):
        yield
        return
    if os.environ.get(MAY_SET_SHMEM) != "1":
        pytest.skip(f"shmem_enabled is {before!r}, which keeps shared memory off huge pages, "
                    f"and a test does not change a kernel setting unless asked: set "
                    f"{MAY_SET_SHMEM}=1 (as root) to let it write 'advise' for its duration")
    if not os.access(SHMEM_ENABLED, os.W_OK):
        pytest.skip(f"shmem_enabled is {before!r} and not writable here (not root)")
    with open(SHMEM_ENABLED, "w") as f:
        f.write("advise")
    try:
        yield
    finally:
        with open(SHMEM_ENABLED, "w") as f:
            f.write(before)


def test_shards_are_on_huge_pages_where_shared_memory_may_be(shmem_allows_huge_pages):
    from distemb.transport.shm import ShmArena, attach
    arena = ShmArena("pages", 1)
    shape = (32 << 20) // (128 * 4), 128
    arr = arena.allocate(shape, "float32")  # its pages exist (reserved) before the advice
    try:
        arr[::977] = 2.0
        view = attach(arena.dup_segment(arr), shape, "float32")
        assert view.read(lambda a: a[::977].copy()).min() == 2.0
        served, mapped = (mapping_of(a.ctypes.data).get("ShmemPmdMapped", 0) << 10
                          for a in (arr, view.array))
        assert served >= arr.nbytes - 2 * (2 << 20), served
        assert mapped > 0, "the trainer's read-only map is on 4 KiB pages"
        del view
    finally:
        arena.close()


def test_a_new_shard_and_a_trainers_map_of_it_are_mapped_before_any_step():
    """Every page of a new shard is in the server's map at allocation and in the
    trainer's when it attaches, whatever the page size: a page first touched inside a
    step costs that step a fault (a fresh optimizer state's pages made a co-located job's
    first steps slow). Neither end writes or reads a row here."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE/READ need Linux 5.14 (pages come at first touch)")
    from distemb.transport.shm import ShmArena, attach
    arena = ShmArena("populate", 0)
    shape = (8 << 20) // (64 * 4), 64
    try:
        arr = arena.allocate(shape, "float32")
        view = attach(arena.dup_segment(arr), shape, "float32")
        kb = arr.nbytes >> 10
        assert mapping_of(arr.ctypes.data)["Rss"] >= kb, "the server's map of its shard"
        assert mapping_of(view.array.ctypes.data)["Rss"] >= kb, "the trainer's map"
        del view
    finally:
        arena.close()


def test_a_dense_stores_zero_filled_column_is_mapped_at_allocation():
    """A fresh optimizer state (zeros) has every page mapped before any step: np.zeros
    alone maps none, and each page first touched inside a step costs that step a fault
    (a 5M-row Adagrad state's updates ran 19x slower until every page was touched)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14 (pages come at first touch)")
    store = DenseStore(ROWS // 2, 128, init=lambda k: np.ones((len(k), 128), np.float32))
    store.add_column("state", (128,), "float32")  # fill 0: nothing written
    col = store.column("state")
    assert mapped_bytes(col, "Rss") >= col.nbytes
    assert not col.any()
