"""The package and its command lines work without the compiled kernels.

Two ways to be without them: ``DISTEMB_NO_EXT=1`` (the switch ``make test``'s twin pass
sets), and an install whose extensions were never built (their import fails). Each
runs in a fresh process, so the modules' import-time choices (``HAS_EXT``, the hash
index's and the half kernels' pick) are made as a user's process makes them: every
module of the package imports, every default picks the numpy twin, and a table trains
one step. The command lines answer ``--help`` and a dry run under the switch.
"""
import os
import subprocess
import sys

import pytest

from mp_helper import ROOT, child_env

#: Extension modules of the package (setup.py): each one's absence must be survivable.
EXTENSIONS = ("_kernels", "_halfkernels", "_hashtable", "_skipgram", "_cachebook")

IMPORT_ALL = r"""
import importlib, pkgutil, sys
import numpy as np
import distemb
from distemb import kernels
from distemb.kernels import cachebook, half, hashtable, skipgram
assert not kernels.HAS_EXT and kernels.active() == "reference", kernels.IMPL_NAME
assert kernels.available_cpu_isas() == () and kernels.ISA == ""
assert hashtable.HashIndex().native is False
assert half._impl() is half.reference_half and skipgram._compiled is None
assert cachebook._impl() is cachebook.reference_cachebook
optional = {"dgl", "torch_geometric"}  # extras: a module needing a missing one is skipped
imported, skipped = 0, []
for info in pkgutil.walk_packages(distemb.__path__, "distemb."):
    if info.name.rsplit(".", 1)[-1] in %r + ("_cuda_kernels",):
        continue  # the compiled modules themselves (and the CUDA library ctypes loads)
    try:
        importlib.import_module(info.name)
        imported += 1
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] not in optional:
            raise
        skipped.append(info.name)
compiled = [m for m in sys.modules if m.split(".")[-1] in %r and sys.modules[m] is not None]
assert not compiled, compiled
emb = distemb.DistEmbedding(10, 4, name="t")
opt = distemb.SparseAdagrad([emb], lr=0.1)
import torch
emb(torch.tensor([1, 1, 3])).sum().backward()
opt.step()
rows = emb.weight[torch.tensor([1, 3])]
assert torch.all(rows != emb.weight[torch.tensor([0, 0])]), rows
print("imported", imported, "skipped", skipped)
""" % (EXTENSIONS, EXTENSIONS)

#: Makes the extension modules fail to import, as in an install that never built them.
NOT_BUILT = "import sys\n" + "".join(f"sys.modules['distemb.{e}'] = None\n"
                                     for e in EXTENSIONS)


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(**env),
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("how", ["DISTEMB_NO_EXT=1", "not built"])
def test_every_module_imports_and_a_table_trains_on_the_twins(how):
    if how == "not built":
        run = _python(NOT_BUILT + IMPORT_ALL, DISTEMB_NO_EXT="")
    else:
        run = _python(IMPORT_ALL, DISTEMB_NO_EXT="1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported" in run.stdout and int(run.stdout.split()[1]) > 50, run.stdout


@pytest.mark.parametrize("argv", [
    ["-m", "distemb.launch", "--help"],
    ["-m", "distemb.server", "--help"],
    ["-m", "distemb.dgl.patch", "--help"],
    ["-m", "distemb.launch", "--ip-config", "{ip}", "--num-servers", "2", "--num-trainers",
     "2", "--config-out", "{tmp}/cluster.json", "--dry-run", "--", "python", "train.py"],
], ids=["launch-help", "server-help", "dgl-patch-help", "launch-dry-run"])
def test_command_lines_run_without_the_extension(argv, tmp_path):
    ip = tmp_path / "ip.txt"
    ip.write_text("127.0.0.1 30050\n")
    argv = [a.format(ip=ip, tmp=tmp_path) for a in argv]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                         env=child_env(DISTEMB_NO_EXT="1"), timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    if "--dry-run" in argv:
        assert "distemb.server" in run.stdout and "train.py" in run.stdout, run.stdout
