"""Reference twins of the half-precision kernels (``csrc/cpu_kernels.h``), in numpy.

Each decodes the touched rows to float32, runs the float32 reference kernel
(:mod:`distemb.kernels.reference`) on them, and encodes the result with
round-to-nearest-even: the definition the compiled kernels follow. ``kind`` is 0 for
bfloat16 (uint16 bits), 1 for IEEE float16, 2 for bfloat16 with stochastic rounding of
the updated rows (``seed`` picks the random bits); weights arrive as their uint16 bits.
"""
import numpy as np

from distemb.kernels import reference, rule_table

BF16, F16, BF16_SR = 0, 1, 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x):
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stochastic(values, rows, seed):
    """bfloat16 bits of ``values`` (n, d) rounded stochastically, as csrc/cpu_kernels.h:
    16 random bits, a hash of (seed, slot, column), added below the kept bits."""
    with np.errstate(over="ignore"):
        stream = _splitmix(np.uint64(seed) ^ _splitmix(rows.astype(np.int64).view(np.uint64)))
        cols = np.arange(1, values.shape[1] + 1, dtype=np.uint64) * _GOLDEN
        rnd = (_splitmix(stream[:, None] + cols[None, :]) >> np.uint64(48)).astype(np.uint32)
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), (u + rnd) >> np.uint32(16))


def decode(kind, src, dst):
    """dst (float32) = the values of the half bits ``src``."""
    if kind in (BF16, BF16_SR):
        dst[...] = (src.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        dst[...] = src.view(np.float16).astype(np.float32)


def encode(kind, src, dst):
    """dst (uint16 bits) = ``src`` (float32) rounded to nearest, ties to even."""
    if kind == BF16:
        u = np.ascontiguousarray(src, dtype=np.float32).view(np.uint32)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> 16
        dst[...] = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    else:
        with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as IEEE says
            dst[...] = src.astype(np.float16).view(np.uint16)


def _rows(kind, weight, rows):
    out = np.empty((rows.shape[0], weight.shape[1]), np.float32)
    decode(kind, weight[rows], out)
    return out


def _store(kind, weight, rows, values, seed):
    if kind == BF16_SR:
        weight[rows] = _stochastic(values, rows, seed).astype(np.uint16)
        return
    bits = np.empty(values.shape, np.uint16)
    encode(kind, values, bits)
    weight[rows] = bits


def gather_rows(kind, table, rows, out, num_threads=1):
    decode(kind, table[rows], out)


def rowwise_adagrad_update(kind, weight, state_sum, rows, grads, clr, eps, seed=0,
                           num_threads=1):
    w, s = _rows(kind, weight, rows), state_sum[rows]
    reference.rowwise_adagrad_update(w, s, np.arange(len(rows)), grads, clr, eps)
    state_sum[rows] = s
    _store(kind, weight, rows, w, seed)


def adam_update(kind, weight, exp_avg, exp_avg_sq, rows, grads, lr, beta1, beta2, eps, step,
                row_steps=None, seed=0, num_threads=1):
    w, m, v = _rows(kind, weight, rows), exp_avg[rows], exp_avg_sq[rows]
    rs = None if row_steps is None else row_steps[rows]
    reference.adam_update(w, m, v, np.arange(len(rows)), grads, lr, beta1, beta2, eps, step,
                          row_steps=rs)
    exp_avg[rows], exp_avg_sq[rows] = m, v
    if rs is not None:
        row_steps[rows] = rs
    _store(kind, weight, rows, w, seed)


def _elementwise(rule):
    """The half twin of an element-wise rule, made from its table entry: decode the rows,
    the float32 twin on them and their states' rows, write the states back, encode."""
    states = "".join(f"    {s}_rows = {s}[rows]\n" for s in rule.states)
    back = "".join(f"    {s}[rows] = {s}_rows\n" for s in rule.states)
    args = "".join(f"{s}_rows, " for s in rule.states)
    params = rule.params().replace("num_threads=1", "seed=0, num_threads=1")
    source = (
        f"def {rule.kernel}(kind, {params}):\n"
        "    w = _rows(kind, weight, rows)\n" + states
        + f"    reference.{rule.kernel}(w, {args}np.arange(len(rows)), grads, "
          f"{', '.join(rule.hyper_names)})\n"
        + back + "    _store(kind, weight, rows, w, seed)\n")
    return rule_table.define(source, globals(), rule.kernel,
                             f"The half twin of reference.{rule.kernel} (decode, twin, encode).")


# sgd_update, adagrad_update, ftrl_update, ...: one per rule of the table.
for _rule in rule_table.RULES:
    globals()[_rule.kernel] = _elementwise(_rule)
del _rule
