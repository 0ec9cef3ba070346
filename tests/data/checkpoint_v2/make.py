"""Write the version-2 checkpoint fixtures of tests/test_checkpoint_formats.py with the
code of distemb before version 3 (run from a checkout of 671dfce)."""
import sys
import numpy as np
from distemb import checkpoint
from distemb.kvstore import LocalKVClient
from distemb.partition import range_policy
from distemb.stores import HashStore

out = sys.argv[1]
rows, dim = 12, 3
kv = LocalKVClient()
kv.init_data("dense", (rows, dim), "float32", range_policy(rows, 2))
k = np.arange(rows)
kv.push("dense", k, (k[:, None] * 0.5 + np.arange(dim)).astype(np.float32))
kv.init_optimizer("dense", "adagrad", {"initial_accumulator_value": 0.0})
kv.push("dense~opt~sum", k, (k[:, None] + 0.25 + np.zeros(dim)).astype(np.float32))
checkpoint.save(f"{out}/dense", kv, ["dense", "dense~opt~sum"], {"note": "v2 dense"})
kv.add_table("keyed", HashStore(dim))
kv.init_optimizer("keyed", "adagrad", {"initial_accumulator_value": 0.0})
keys = np.array([-7, 3, 2 ** 40, 11], np.int64)
kv.push("keyed", keys, (keys[:, None] * 0.5 + np.arange(dim)).astype(np.float32))
kv.import_("keyed", keys, {"sum": (keys[:, None] + 0.25 + np.zeros(dim)).astype(np.float32)})
checkpoint.save(f"{out}/keyed", kv, ["keyed"], {"note": "v2 keyed"})
