"""FileStore beyond the shared suite: persistence, durability under SIGKILL, bad disks.

The kill test runs a real trainer process on a file-backed table: it trains, flushes,
reports, trains on without flushing, and is killed with SIGKILL. The reopened files must
hold at least every flushed step (here: every completed step, since the page cache
survives a process) and match a table trained in memory on the same batches.
"""
import os
import re
import signal
import stat
import sys
import subprocess
import textwrap

import numpy as np
import pytest
import torch

from distemb.dynamic import StoreEmbedding
from distemb.errors import StoreError
from distemb.optim import SparseAdagrad
from distemb.stores import DenseStore, FileStore, key_normal, key_uniform
from tests.mp_helper import ProcessGroup


def test_reopen_keeps_rows_and_optimizer_state(ctx, tmp_path):
    path = tmp_path / "t"
    emb = StoreEmbedding(FileStore(path, num_rows=1000, dim=4, init=key_uniform(4)),
                         name="f1", context=ctx)
    opt = SparseAdagrad([emb], lr=0.5)
    ids = torch.tensor([0, 999, 999, 500])
    emb(ids).sum().backward()
    opt.step()
    rows, state = emb.weight[ids], emb.store.gather(ids.numpy(), "sum")
    emb.close()
    again = StoreEmbedding(FileStore(path), name="f2", context=ctx)
    SparseAdagrad([again], lr=0.5)  # a persistent store keeps its state columns
    assert torch.equal(again.weight[ids], rows)
    np.testing.assert_array_equal(again.store.gather(ids.numpy(), "sum"), state)
    again.close()
    with pytest.raises(StoreError, match="dim: the FileStore .* has dim=4, got 5"):
        FileStore(path, num_rows=1000, dim=5)


def test_files_are_sparse_until_written(tmp_path):
    s = FileStore(tmp_path / "sparse", num_rows=1 << 20, dim=64, preallocate=False)
    s.scatter(np.array([12345]), np.ones((1, 64), np.float32))
    s.flush()
    st = os.stat(tmp_path / "sparse" / "weight.bin")
    assert st.st_size == (1 << 20) * 64 * 4 and st.st_blocks * 512 < st.st_size // 100
    assert s.gather(np.array([12345, 0]))[:, 0].tolist() == [1.0, 0.0]
    s.close()


def test_read_only_or_too_full_disk_fails_up_front(tmp_path):
    if os.geteuid() == 0:  # root writes through permissions: use a file system that refuses
        bad = "/sys/distemb-file-store"
    else:
        bad = tmp_path / "ro"
        bad.mkdir()
        bad.chmod(0o500)
    unwritable = r"path: (cannot create directory|directory .* is not writable)"
    with pytest.raises(StoreError, match=unwritable):
        FileStore(bad, num_rows=10, dim=2)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    rows = free // (4 * 1024) * 2  # twice the free space
    with pytest.raises(StoreError, match="No space left on device"):
        FileStore(tmp_path / "huge", num_rows=int(rows), dim=1024)
    assert not (tmp_path / "huge" / "weight.bin").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreError, match="cannot create directory"):
        FileStore(tmp_path / "afile" / "sub", num_rows=10, dim=2)


CHILD = textwrap.dedent("""
    import sys, numpy as np, torch
    from distemb.dynamic import StoreEmbedding
    from distemb.optim import SparseAdagrad
    from distemb.stores import FileStore, key_uniform
    path, flushed, more = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    emb = StoreEmbedding(FileStore(path, num_rows=5000, dim=8, init=key_uniform(8)))
    opt = SparseAdagrad([emb], lr=0.1)
    rng = np.random.default_rng(0)
    for step in range(1, flushed + more + 1):
        ids = torch.from_numpy(rng.integers(0, 5000, 512))
        g = torch.from_numpy(rng.standard_normal((512, 8)).astype(np.float32))
        (emb(ids) * g).sum().backward()
        opt.step()
        if step == flushed:
            emb.flush()
    print("ready", step, flush=True)
    sys.stdin.readline()  # killed here, never closed: no flush after step `flushed`
""")


def replay(ctx, steps):
    """The table after ``steps`` steps of the child's batches, trained in memory."""
    emb = StoreEmbedding(DenseStore(5000, 8, init=key_uniform(8)), context=ctx)
    opt = SparseAdagrad([emb], lr=0.1)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, 5000, 512))
        g = torch.from_numpy(rng.standard_normal((512, 8)).astype(np.float32))
        (emb(ids) * g).sum().backward()
        opt.step()
    return emb.store.export()[1]


@pytest.mark.timeout(60)
def test_sigkill_loses_no_completed_step(ctx, tmp_path):
    path, flushed, more = str(tmp_path / "crash"), 10, 3
    with ProcessGroup() as group:
        p = group.spawn([sys.executable, "-c", CHILD, path, str(flushed), str(more)],
                        expect=None, stdin=subprocess.PIPE)
        line = p.stdout.readline()
        assert line.startswith("ready"), line + p.stdout.read()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    assert p.returncode == -signal.SIGKILL
    on_disk = FileStore(path).export()[1]
    want = replay(ctx, flushed + more)  # the page cache kept even the unflushed steps
    for name in ("weight", "sum"):
        np.testing.assert_array_equal(on_disk[name], want[name])
    assert not np.array_equal(on_disk["weight"], replay(ctx, flushed)["weight"])


@pytest.mark.parametrize("field", ["num_rows", "dim", "dtype", "columns"])
def test_metadata_lacking_a_field_is_refused_naming_the_file_and_the_field(tmp_path, field):
    """A meta.json without one of its fields was a raw KeyError; the store is refused
    naming both, and the directory is left unlocked (it opens once the file is whole)."""
    import json

    FileStore(tmp_path / "t", num_rows=10, dim=2).close()
    meta_path = tmp_path / "t" / "meta.json"
    whole = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({k: v for k, v in whole.items() if k != field}))
    with pytest.raises(StoreError, match=rf"path: {re.escape(str(meta_path))} lacks the "
                                         rf"field\(s\) \['{field}'\] of a FileStore's "
                                         r"metadata"):
        FileStore(tmp_path / "t")
    meta_path.write_text(json.dumps(whole))
    FileStore(tmp_path / "t").close()


def test_a_second_opener_of_the_directory_is_refused(tmp_path):
    """One writer per FileStore directory: a second FileStore (this process or another)
    gets a clear error while the first is open, and opens once it is closed."""
    first = FileStore(tmp_path / "t", num_rows=10, dim=2)
    with pytest.raises(StoreError, match=r"is open in process \d+ .*close it first"):
        FileStore(tmp_path / "t")
    code = textwrap.dedent(f"""
        from distemb.errors import StoreError
        from distemb.stores import FileStore
        try:
            FileStore({str(tmp_path / 't')!r})
        except StoreError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "refused:" in out.stdout and "is open in process" in out.stdout, out.stderr
    first.close()
    FileStore(tmp_path / "t").close()


def test_a_new_table_s_directory_and_files_are_private_to_their_user(tmp_path):
    """Like the shared-memory files (issue 18): another local user reads no rows."""
    s = FileStore(tmp_path / "t", num_rows=10, dim=2)
    s.add_column("sum", (2,), "float32")
    s.close()
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    files = [f for f in os.listdir(tmp_path / "t") if f.endswith(".bin")]
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(os.stat(tmp_path / "t" / f).st_mode) == 0o600, f


def test_a_creation_whose_init_fails_leaves_no_store(tmp_path):
    """The metadata is written last: a creation that failed is made again by the next
    open (its init runs), never reopened as a store of zeros."""
    path = str(tmp_path / "t")

    def bad(keys):
        raise RuntimeError("init failed")

    with pytest.raises(RuntimeError, match="init failed"):
        FileStore(path, num_rows=10, dim=4, init=bad)
    good = key_normal(4, std=1.0)
    s = FileStore(path, num_rows=10, dim=4, init=good)
    try:
        np.testing.assert_array_equal(s.gather(np.arange(10)), good(np.arange(10)))
    finally:
        s.close()
