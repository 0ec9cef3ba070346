"""Runs benchmarks/dgl_kvstore_job.py's train_step on DGL 1.1.3 itself (standalone mode)
and prints JSON: DGL's trace length after each step and the final rows.

``python tests/dgl_bench_step.py OUT_DIR``; used by tests/test_bench_baselines.py.
"""
import json
import os
import sys

os.environ.setdefault("DGLBACKEND", "pytorch")

import torch  # noqa: E402

import dgl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import dgl_kvstore_job as job  # noqa: E402


def main(out):
    g = dgl.graph((torch.arange(99), torch.arange(1, 100)), num_nodes=100)
    g.ndata["x"] = torch.zeros(100, 1)  # DGL registers its node policy from node data
    dgl.distributed.partition_graph(g, "g", 1, os.path.join(out, "parts"))
    with open(os.path.join(out, "ip.txt"), "w") as f:
        f.write("127.0.0.1\n")
    dgl.distributed.initialize(os.path.join(out, "ip.txt"))
    dg = dgl.distributed.DistGraph("g", part_config=os.path.join(out, "parts", "g.json"))
    emb = dgl.distributed.DistEmbedding(dg.num_nodes(), 4, name="bench",
                                        init_func=job.init_emb)
    opt = dgl.distributed.optim.SparseAdagrad([emb], lr=0.1)
    ids = torch.tensor([3, 7, 11])
    traces = []
    for _ in range(5):
        job.train_step(emb, opt, ids)
        traces.append(len(emb._trace))
    rows = emb.weight[torch.arange(12)].tolist()
    print(json.dumps({"traces": traces, "rows": rows}), flush=True)
    dgl.distributed.exit_client()


if __name__ == "__main__":
    main(sys.argv[1])
