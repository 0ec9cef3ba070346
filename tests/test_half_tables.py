"""Tables with half-precision rows against the float32 table (the oracle), every optimizer.

Stated tolerance: after 50 steps of zipf ids (as tests/test_optim_oracle.py), every
entry is within ``HALF_TOL[dtype] * max|w|`` of the float32 table (bfloat16 keeps 8
significant bits, float16 11; each update rounds once, to nearest-even). Measured here:
bfloat16 1.3-1.6e-2 (SGD, Adagrad), 3.6e-2 (Adam: its steps of ~lr = 0.01 are below half
a bfloat16 ulp of rows near 2, and round away; stochastic rounding would keep them in
expectation); float16 1.3-2.7e-3. The exact property is tested per kernel in
tests/test_half_kernels.py.
"""
import numpy as np
import pytest
import torch

from distemb.dynamic import DynamicEmbedding, StoreEmbedding
from distemb.embedding import DistEmbedding
from distemb.kernels import half
from distemb.optim import SparseSGD
from distemb.stores import DenseStore, key_normal
from tests.conftest import zipf_ids
from tests.test_optim_oracle import CASES

HALF_TOL = {"bfloat16": 5e-2, "float16": 5e-3}
STEPS, ROWS, BATCH, DIM = 50, 300, 256, 16


@pytest.mark.parametrize("dtype", sorted(HALF_TOL))
@pytest.mark.parametrize("case", ["sgd", "adagrad", "rowwise_adagrad", "adam",
                                  "adam-per-row"])
def test_half_rows_track_the_float32_table(ctx, case, dtype):
    make_opt = CASES[case][0]
    init = key_normal(DIM, seed=2)
    w0 = half.decode(half.encode(init(np.arange(ROWS)), dtype))  # the same start
    ref = DistEmbedding(ROWS, DIM, name=f"ref-{case}", context=ctx)
    ref.weight[torch.arange(ROWS)] = torch.from_numpy(w0)
    emb = StoreEmbedding(DenseStore(ROWS, DIM, dtype=dtype, init=init), context=ctx)
    opts = make_opt([ref]), make_opt([emb])
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        ids = torch.from_numpy(zipf_ids(rng, ROWS, BATCH))
        up = torch.randn(BATCH, DIM, generator=gen)
        for table, opt in zip((ref, emb), opts):
            (table(ids) * up).sum().backward()
            opt.step()
    want = ref.weight[torch.arange(ROWS)]
    got = emb.weight[torch.arange(ROWS)]
    assert got.dtype == torch.float32
    assert (want - torch.from_numpy(w0)).abs().max() > 1e-2
    err = float((got - want).abs().max() / want.abs().max())
    assert err < HALF_TOL[dtype], f"{dtype}: max error {err:.2e} of max|w|"
    assert err > 0  # rows really are stored in half precision


def test_dynamic_table_in_bfloat16(ctx):
    emb = DynamicEmbedding(4, dtype=torch.bfloat16, context=ctx)
    emb.upsert(torch.tensor([7]), torch.tensor([[1.0 + 2 ** -9, 2.0, 3.0, 1.0 + 3 * 2 ** -9]]))
    # ties round to even: 1 + 2^-9 -> 1, 1 + 3 * 2^-9 -> 1 + 2^-7
    assert emb.get(torch.tensor([7])).tolist() == [[1.0, 2.0, 3.0, 1.0 + 2 ** -7]]
    assert emb.store.columns()["weight"] == ((4,), "bfloat16")
    assert emb.export()["weight"].dtype == np.float32
    with pytest.raises(ValueError, match="dtype: expected one of"):
        DynamicEmbedding(4, dtype="int8", context=ctx)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["dense", "hash", "file"])
def test_rows_in_the_table_s_own_dtype_are_written(ctx, tmp_path, kind, dtype):
    """``weight[ids] = rows`` takes float32 rows or rows of the table's own dtype, whatever
    the table's kind (a float16 hash or file table refused float16 rows)."""
    from distemb.stores.spec import FileTableSpec

    emb = {"dense": lambda: DistEmbedding(10, 4, name="own", context=ctx, dtype=dtype),
           "hash": lambda: DynamicEmbedding(4, name="own", context=ctx, dtype=dtype),
           "file": lambda: StoreEmbedding(FileTableSpec(str(tmp_path), 10, 4, dtype=dtype,
                                                        preallocate=False),
                                          name="own", context=ctx)}[kind]()
    rows = torch.tensor([[0.5, 1.5, -2.0, 3.0]])
    emb.weight[torch.tensor([1])] = rows.to(emb.dtype)
    emb.weight[torch.tensor([2])] = rows
    assert emb.get(torch.tensor([1, 2])).tolist() == [rows[0].tolist()] * 2
    with pytest.raises(TypeError, match=r"values: expected dtype .*got float64"):
        emb.weight[torch.tensor([3])] = rows.double()


def _small_steps(ctx, rounding, steps=100):
    """Rows at 1.0, SGD steps of 1e-3 (an eighth of a bfloat16 ulp at 1.0) for ``steps``."""
    store = DenseStore(64, 8, dtype="bfloat16", init=lambda k: np.ones((len(k), 8), np.float32),
                       rounding=rounding)
    emb = StoreEmbedding(store, context=ctx)
    opt = SparseSGD([emb], lr=1e-3)
    for _ in range(steps):
        emb(torch.arange(64)).sum().backward()  # gradient 1 for every element
        opt.step()
    return emb.weight[torch.arange(64)]


def test_stochastic_rounding_keeps_updates_below_half_an_ulp(ctx):
    want = 1.0 - 100 * 1e-3  # the float32 result
    nearest = _small_steps(ctx, "nearest")
    assert torch.equal(nearest, torch.ones(64, 8))  # every step rounded away
    stochastic = _small_steps(ctx, "stochastic")
    assert abs(float(stochastic.mean()) - want) < 0.01  # unbiased: 0.9 in expectation
    assert torch.equal(stochastic, _small_steps(ctx, "stochastic"))  # reproducible


def test_rounding_argument_errors(ctx):
    with pytest.raises(ValueError, match="rounding: 'stochastic' is for bfloat16"):
        DenseStore(4, 2, dtype="float16", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding: must be one of"):
        DynamicEmbedding(2, dtype="bfloat16", rounding="up", context=ctx)


def test_rounding_of_a_table_on_row_stores_is_the_storage_s_and_a_seed_is_refused(ctx,
                                                                                tmp_path):
    """``rounding=`` and ``rounding_seed=`` were ignored for a table on row stores. A
    rounding that contradicts the storage's is refused as a contradicting dtype is (the
    default, 'nearest', means the storage's own); a seed is refused, saying why: a store
    rounds from seed 0, and the spec a server makes its stores from carries no seed."""
    from distemb.stores.spec import FileTableSpec, HashTableSpec

    for storage in (HashTableSpec(4, dtype="bfloat16"), DenseStore(10, 4, dtype="bfloat16"),
                    FileTableSpec(str(tmp_path), 10, 4, dtype="bfloat16", preallocate=False)):
        with pytest.raises(ValueError, match=r"rounding: the storage rounds 'nearest', got "
                                             r"rounding 'stochastic'"):
            DistEmbedding(None, 4, dtype=torch.bfloat16, rounding="stochastic",
                          storage=storage, context=ctx)
    assert ctx.client.names() == [] and not list(tmp_path.iterdir())
    stochastic = HashTableSpec(4, dtype="bfloat16", rounding="stochastic")
    for kw in ({"rounding": "stochastic"}, {}):  # the storage's own, or the default
        emb = DistEmbedding(None, 4, dtype=torch.bfloat16, storage=stochastic,
                            context=ctx, **kw)
        assert emb.store.rounding.value == "stochastic"
    emb = DistEmbedding(None, 4, rounding="stochastic", storage=stochastic, context=ctx)
    assert emb.dtype == torch.bfloat16  # checked against the storage's dtype, not float32
    emb = DistEmbedding(None, 4, dtype=torch.bfloat16, rounding="stochastic", context=ctx)
    assert emb.store.rounding.value == "stochastic"  # a hash table made from the arguments
    for storage in (None, stochastic, DenseStore(10, 4, dtype="bfloat16")):
        with pytest.raises(ValueError, match=r"rounding_seed: a table on row stores takes no "
                                             r"seed .*the table spec .* carries none.*got "
                                             r"rounding_seed=7"):
            DistEmbedding(None, 4, dtype=torch.bfloat16, rounding="stochastic",
                          rounding_seed=7, storage=storage, context=ctx)
