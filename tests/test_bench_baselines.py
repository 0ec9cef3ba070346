"""Benchmark baselines are used as their documentation says (DGL: zero_grad() every step).

benchmarks/dgl_kvstore_job.py's timed step runs here on DGL 1.1.3 itself (standalone
mode, in a subprocess): DGL's trace must not grow, and five steps on the same three ids
must equal five applications of DGL's update, each once (a step that re-applies earlier
lookups' stale gradients, as without zero_grad(), moves the rows further).

DGL 1.1.3's SparseAdagrad is not torch's Adagrad on the CPU: ``grad_state.sqrt_()`` runs
in place on the tensor it then writes back as the state (``.to("cpu")`` of a CPU tensor
is the same tensor), so the stored state is ``sqrt(s + g^2) + eps``, not ``s + g^2``.
The oracle below is that recurrence (it matches DGL's printed state step by step).
"""
import json
import os
import sys

import pytest
import torch

from mp_helper import ProcessGroup

pytest.importorskip("distemb.integrations.dgl")  # DGL installed (not on the GPU machine)


def test_dgl_kvstore_job_step_is_dgls_documented_loop(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "dgl_bench_step.py")
    with ProcessGroup() as group:
        p = group.spawn([sys.executable, script, str(tmp_path)])
        out = group.wait_all(timeout=120)[p.pid]
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert max(got["traces"]) <= 1, got["traces"]

    w = torch.full((12, 4), 0.01, dtype=torch.float64)
    state = torch.zeros(12, 4, dtype=torch.float64)
    ids, lr, eps = torch.tensor([3, 7, 11]), 0.1, 1e-10
    for _ in range(5):
        g = torch.ones(3, 4, dtype=torch.float64)  # d(sum)/d(row), each id once
        std = (state[ids] + g * g).sqrt() + eps
        state[ids] = std                            # DGL's aliased write-back
        w[ids] -= lr * g / std
    torch.testing.assert_close(torch.tensor(got["rows"], dtype=torch.float64), w,
                               rtol=1e-5, atol=1e-6)
