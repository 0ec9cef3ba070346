"""distemb.serving: a checkpoint read into a read-only module, without any KVClient.

Oracle: every lookup of the served module equals the training table's rows of those
keys (pulled from the table that wrote the checkpoint) bit for bit, or those rows as
torch rounds them to float16/bfloat16; pooled lookups equal ``nn.functional.embedding_bag``
over them. Checkpoints come from one embedded process, from a job of 2 servers x 2
trainers, from collective ranks (one in this process, and two gloo processes running
tests/collective_trainer.py), for every table kind of the client suite
(tests/suite_tables.py: dense, hash and file stores, float32 and 16-bit rows, range,
hash and DGL routers), and from the version-2 fixtures in tests/data (rows known
arithmetic functions of their keys).
"""
import json
import os

import numpy as np
import pytest
import torch

from conftest import make_placement
from suite_tables import Table
from test_kvclient_jobs import dyadic_job
from test_collective import run_job

import collective_trainer
from distemb import serving
from distemb.errors import KVStoreError, MissingKeyError
from distemb.serving import KeyedEmbedding

pytestmark = pytest.mark.timeout(180)
V2 = os.path.join(os.path.dirname(__file__), "data", "checkpoint_v2")
WRITERS = ["embedded", "tcp2x2", "collective1"]


def held_keys(client, t):
    """The keys table ``t`` holds on ``client`` (every key of a fixed-key table)."""
    return client.export(t.name)[0] if t.store == "hash" else t.all_keys()


def assert_serves(module, keys, rows):
    """``module`` looks ``keys`` up as ``rows`` (float32), bit for bit, in any shape;
    in float16 and bfloat16, as torch rounds them."""
    ids = torch.from_numpy(keys)
    assert torch.equal(module(ids), torch.from_numpy(rows))
    assert torch.equal(module(ids.reshape(1, -1, 1)), torch.from_numpy(rows)[None, :, None])


@pytest.mark.parametrize("writer", WRITERS)
def test_served_rows_are_the_training_tables(writer, table_kind, clusters, tmp_path):
    """Trained and saved on ``writer``; the served module's rows are the table's (every
    table kind: tests/conftest.py parametrizes ``table_kind``)."""
    t = Table(table_kind, 40, 4, str(tmp_path))
    ck = str(tmp_path / "ck")
    where = make_placement(writer, clusters)
    try:
        where.run(dyadic_job(t, "adagrad", 4, save=ck))
        keys = held_keys(where.client, t)
        rows = where.client.pull(t.name, keys)
    finally:  # as the placement fixture leaves a placement
        for name in where.client.names():
            if "~opt~" not in name:
                where.client.delete_data(name)
        where.client.close(**({"goodbye": False} if writer == "tcp2x2" else {}))
    assert np.abs(rows - t.initial(t.row_of(keys))).max() > 0.05, "the table did not train"
    served = serving.load(ck)
    assert served.weight.requires_grad is False
    if t.store == "hash":
        assert isinstance(served, KeyedEmbedding) and len(served) == len(keys)
    else:
        assert isinstance(served, torch.nn.Embedding) and served.weight.shape == (40, 4)
    assert_serves(served, keys, rows)
    for dtype in (torch.float16, torch.bfloat16):
        half = serving.load(ck, t.name, dtype=dtype)
        assert half.weight.dtype == dtype
        assert torch.equal(half(torch.from_numpy(keys)), torch.from_numpy(rows).to(dtype))


def test_pooled_serving_equals_embedding_bag_over_the_rows(ctx, tmp_path):
    """``mode=``: an nn.EmbeddingBag for fixed keys, a pooled KeyedEmbedding for a hash
    table; both as F.embedding_bag over the training table's rows."""
    ck = str(tmp_path / "ck")
    for kind in ("dense-range", "hash-key"):
        t = Table(kind, 30, 3, str(tmp_path), name=kind)
        emb = t.embedding(ctx)
        emb(torch.from_numpy(t.all_keys()))  # every key held
        from distemb.optim import SparseAdagrad
        SparseAdagrad([emb], lr=0.1).save(f"{ck}-{kind}")
    rng = np.random.default_rng(0)
    positions = torch.from_numpy(rng.integers(0, 30, 50))
    offsets = torch.tensor([0, 7, 7, 20, 41])
    weights = torch.rand(50)
    for kind in ("dense-range", "hash-key"):
        t = Table(kind, 30, 3, str(tmp_path), name=kind)
        rows = torch.from_numpy(ctx.client.pull(kind, t.all_keys()))
        keys = torch.from_numpy(t.key_of(positions.numpy()))
        for mode in ("sum", "mean", "max"):
            served = serving.load(f"{ck}-{kind}", mode=mode)
            assert isinstance(served, torch.nn.EmbeddingBag if kind.startswith("dense")
                              else KeyedEmbedding)
            w = weights if mode == "sum" else None
            want = torch.nn.functional.embedding_bag(positions, rows, offsets, mode=mode,
                                                     per_sample_weights=w)
            torch.testing.assert_close(served(keys, offsets, per_sample_weights=w), want,
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_checkpoint_of_two_collective_ranks_is_served(tmp_path):
    """tests/collective_trainer.py on 2 gloo ranks saves every table (dense float32 and
    bfloat16, a hash policy's, hash tables of float32 and bfloat16 rows), each rank its
    own shards; rank 0 wrote each table's rows, which the served modules must give."""
    ck = tmp_path / "ck"
    run_job(tmp_path, 2, "--steps", "4", "--save", str(ck))
    served = 0
    for k, directory in [(k, k) for k in collective_trainer.OPTIMIZERS] + \
            [(k, "group") for k, *_ in collective_trainer.GROUP]:
        with np.load(tmp_path / f"{k}.npz") as z:
            want = {c: z[c] for c in z.files}
        module = serving.load(ck / directory, f"coll-{k}")
        keys = want["keys"] if "keys" in want else np.arange(len(want["weight"]))
        assert len(module.weight) == len(keys), k
        assert torch.equal(module(torch.from_numpy(keys)),
                           torch.from_numpy(want["weight"].astype(np.float32))), k
        served += 1
    assert served == len(collective_trainer.OPTIMIZERS) + len(collective_trainer.GROUP)


def test_version_2_checkpoints_are_served():
    """The version-2 fixtures (a dense table of 2 range shards, a keyed table) hold rows
    ``key * 0.5 + column``."""
    def rows_of(keys):
        return torch.from_numpy(keys[:, None] * 0.5 + np.arange(3)).float()

    dense = serving.load(os.path.join(V2, "dense"))
    assert torch.equal(dense(torch.arange(12)), rows_of(np.arange(12)))
    keyed = serving.load(os.path.join(V2, "keyed"))
    keys = np.array([-7, 3, 2 ** 40, 11])
    assert torch.equal(keyed(torch.from_numpy(keys)), rows_of(keys))


def test_a_missing_key_is_an_error_or_the_default_asked_for(ctx, tmp_path):
    """A key the hash table never held: MissingKeyError naming it; with the table's
    initialiser as ``default``, the row the training table would have made; with a row,
    that row."""
    t = Table("hash-key", 20, 4, str(tmp_path), name="hk")
    emb = t.embedding(ctx)
    held = t.all_keys()[:15]
    emb(torch.from_numpy(held))
    from distemb.optim import SparseAdagrad
    SparseAdagrad([emb], lr=0.1).save(str(tmp_path / "ck"))
    absent = t.all_keys()[15:]
    ids = torch.from_numpy(np.concatenate([held[:3], absent]))
    with pytest.raises(MissingKeyError, match=rf"keys: 5 of 8 keys are not in table 'hk' "
                                              rf"\(first: {absent[0]}\); load it with "
                                              rf"default="):
        serving.load(tmp_path / "ck")(ids)
    by_init = serving.load(tmp_path / "ck", default=t.init)(ids)
    emb(torch.from_numpy(absent))  # the training table makes them now: the oracle
    assert torch.equal(by_init, torch.from_numpy(ctx.client.pull("hk", ids.numpy())))
    row = torch.tensor([1.0, -2.0, 3.0, 0.5])
    by_row = serving.load(tmp_path / "ck", default=row)(ids)
    assert torch.equal(by_row[3:], row.expand(5, 4))
    assert torch.equal(by_row[:3], by_init[:3])


def test_the_fixed_key_module_exports(ctx, tmp_path):
    """torch.export exports the served nn.Embedding and nn.EmbeddingBag; the exported
    programs give the module's rows."""
    t = Table("dense-range", 50, 8, str(tmp_path), name="ex")
    emb = t.embedding(ctx)
    from distemb.optim import SparseAdagrad
    SparseAdagrad([emb], lr=0.1).save(str(tmp_path / "ck"))
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    served = serving.load(tmp_path / "ck")
    program = torch.export.export(served, (ids,))
    assert torch.equal(program.module()(ids), served(ids))
    assert torch.equal(served(ids), torch.from_numpy(t.initial(ids.reshape(-1)))
                       .reshape(2, 3, 8))
    bag = serving.load(tmp_path / "ck", mode="mean")
    program = torch.export.export(bag, (ids,))
    assert torch.equal(program.module()(ids), bag(ids))


def test_rows_memory_mapped_from_a_file(ctx, tmp_path):
    """``mmap=``: the rows are in that file (its size is theirs), mapped, not copied."""
    t = Table("dense_bf16-range", 64, 16, str(tmp_path), name="mm")
    emb = t.embedding(ctx)
    from distemb.optim import SparseAdagrad
    SparseAdagrad([emb], lr=0.1).save(str(tmp_path / "ck"))
    path = tmp_path / "rows.bin"
    path.write_bytes(b"stale")  # replaced
    served = serving.load(tmp_path / "ck", dtype="bfloat16", mmap=path)
    assert served.weight.untyped_storage().filename == str(path)
    assert os.path.getsize(path) == 64 * 16 * 2
    want = torch.from_numpy(t.initial()).to(torch.bfloat16)
    assert torch.equal(served(torch.arange(64)), want)
    assert torch.equal(torch.from_file(str(path), size=64 * 16, dtype=torch.bfloat16)
                       .view(64, 16), want)


def test_what_cannot_be_served_is_refused_naming_it(ctx, tmp_path):
    from distemb.embedding import DistEmbedding
    from distemb.optim import SparseAdagrad
    a = DistEmbedding(10, 3, name="a", context=ctx)
    b = DistEmbedding(None, 3, name="b", context=ctx)
    b(torch.tensor([5]))
    ck = tmp_path / "ck"
    SparseAdagrad([a, b], lr=0.1).save(str(ck))
    assert serving.tables(ck) == ["a", "b"]
    cases = [
        (dict(), ValueError, r"table: .* holds 2 tables \['a', 'b'\]; name the one to serve"),
        (dict(table="c"), ValueError, r"table: expected one of \['a', 'b'\] .* got 'c'"),
        (dict(table="a", dtype="int8"), ValueError,
         r"dtype: expected one of \['bfloat16', 'float16', 'float32'\] .* got 'int8'"),
        (dict(table="a", mode="median"), ValueError, r"mode: must be one of"),
        (dict(table="a", default=torch.zeros(3)), ValueError,
         r"default: 'a' holds the fixed keys 0..9, each with its row"),
        (dict(table="b", mmap=str(tmp_path / "m")), ValueError,
         r"mmap: 'b' is a hash table"),
        (dict(table="b", default="zeros"), TypeError, r"default: expected None, a callable"),
        (dict(table="b", default=torch.zeros(2)), ValueError,
         r"default: expected one row of shape \(3,\), got shape \(2,\)"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            serving.load(ck, **kwargs)
    with pytest.raises(KVStoreError, match="not a distemb checkpoint"):
        serving.load(tmp_path)
    (tmp_path / "old.npz").write_bytes(b"PK")
    with pytest.raises(KVStoreError, match=r"old.npz is a file \(a single-file checkpoint"):
        serving.load(tmp_path / "old.npz")
    with pytest.raises(ValueError, match="offsets, per_sample_weights: this module"):
        serving.load(ck, "b")(torch.tensor([5]), torch.tensor([0]))
    manifest = json.loads((ck / "manifest.json").read_text())
    seg = manifest["tensors"]["a"]["shards"][0]["columns"]["weight"]["segment"]["file"]
    data = bytearray((ck / seg).read_bytes())
    data[5] ^= 0xFF
    (ck / seg).write_bytes(bytes(data))
    with pytest.raises(KVStoreError, match="is corrupt"):
        serving.load(ck, "a")
    assert serving.load(ck, "b")(torch.tensor([5])).shape == (1, 3)  # untouched
