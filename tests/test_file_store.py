"""FileStore beyond the shared suite: persistence, durability under SIGKILL, bad disks.

The kill test runs a real trainer process on a file-backed table: it trains, flushes,
reports, trains on without flushing, and is killed with SIGKILL. The reopened files must
hold at least every flushed step (here: every completed step, since the page cache
survives a process) and match a table trained in memory on the same batches.
"""
import os
import re
import shutil
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
from tests.mp_helper import ProcessGroup, child_env


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
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreError, match="cannot create directory"):
        FileStore(tmp_path / "afile" / "sub", num_rows=10, dim=2)


#: A FileStore twice the size of its file system, made in a child process that mounts a
#: 4 MiB tmpfs of its own (a private mount namespace): the machine's disk is shared, and
#: filling it, even while a preallocation fails, fails whatever else writes there.
FULL_DISK = textwrap.dedent("""
    import os, sys
    from distemb.errors import StoreError
    from distemb.stores import FileStore
    path = os.path.join(sys.argv[1], "huge")
    try:
        FileStore(path, num_rows=2048, dim=1024)  # 8 MiB of float32 rows
    except StoreError as e:
        print("REFUSED", e)
    print("LEFT", os.path.exists(os.path.join(path, "weight.bin")))
""")


def test_a_too_full_disk_fails_up_front_and_leaves_no_file(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small file system of its own "
                    "(filling the machine's shared disk would fail other writers)")
    small = tmp_path / "small"
    small.mkdir()
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=4m distemb-test "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(small), sys.executable, FULL_DISK],
        env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"REFUSED path: cannot make the 8388608-byte file of column 'weight' "
                     r".*No space left on device", run.stdout), run.stdout + run.stderr
    assert "LEFT False" in run.stdout, run.stdout


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
