"""A process that is one of several never gets a silent private table.

Real subprocesses, each with the environment a launcher gives it (DGL's tools/launch.py
variables, torchrun's WORLD_SIZE) or in a real 2-process gloo group on 127.0.0.1, and no
$DISTEMB_CONFIG: ``initialize()`` and the first table must raise a DistEmbError that says
how to launch. The controls (a lone process, WORLD_SIZE=1, DGL's standalone mode, an
explicit embedded context) still get an embedded table.
"""
import json
import sys

from mp_helper import ProcessGroup, child_env, free_port

CLEAN = {"DISTEMB_CONFIG": "", "WORLD_SIZE": "", "DGL_ROLE": "", "DGL_IP_CONFIG": "",
         "DGL_NUM_SERVER": "", "DGL_NUM_CLIENT": "", "DGL_CONF_PATH": "",
         "DGL_SERVER_ID": "", "DGL_DIST_MODE": ""}

# One process runs every case: it sets the case's variables in its own environment
# (where distemb reads them), makes a table, prints REFUSED (with the error) or EMBEDDED.
PROBE = """
import json, os, sys, torch, distemb
for env, how in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        if how == "initialize":
            distemb.initialize()
        elif how == "explicit":
            ctx = distemb.DistContext.embedded()
            distemb.DistEmbedding(4, 2, name="t", context=ctx)
        else:
            distemb.DistEmbedding(4, 2, name="t")
    except distemb.DistEmbError as e:
        print("REFUSED", e)
    else:
        print("EMBEDDED")
    distemb.shutdown()
    os.environ.clear()
    os.environ.update(saved)
"""

GLOO = """
import sys, torch, torch.distributed as dist, distemb
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
try:
    distemb.DistEmbedding(4, 2, name="t")
except distemb.DistEmbError as e:
    print("REFUSED", e)
else:
    print("EMBEDDED")
dist.barrier()
dist.destroy_process_group()
"""


def _run(code, args, env_extra, n=1):
    env = child_env(**{**CLEAN, **env_extra})
    for k in [k for k, v in env.items() if v == "" and k in CLEAN]:
        del env[k]
    with ProcessGroup() as group:
        procs = [group.spawn([sys.executable, "-c", code, *a], env=env) for a in args]
        out = group.wait_all(timeout=120)
    return [out[p.pid] for p in procs]


DGL_LAUNCHER = {"DGL_ROLE": "client", "DGL_IP_CONFIG": "ip_config.txt", "DGL_NUM_SERVER": "1",
                "DGL_NUM_CLIENT": "2", "DGL_CONF_PATH": "parts/g.json",
                "DGL_DIST_MODE": "distributed"}


CASES = [
    (DGL_LAUNCHER, "initialize", "REFUSED"),
    (DGL_LAUNCHER, "table", "REFUSED"),
    ({"DGL_DIST_MODE": "distributed"}, "table", "REFUSED"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "initialize", "REFUSED"),
    ({"WORLD_SIZE": "4"}, "table", "REFUSED"),
    ({}, "table", "EMBEDDED"),
    ({"WORLD_SIZE": "1"}, "initialize", "EMBEDDED"),
    ({"DGL_DIST_MODE": "standalone"}, "table", "EMBEDDED"),
    (DGL_LAUNCHER, "explicit", "EMBEDDED"),
]


def test_launcher_environment():
    (out,) = _run(PROBE, [[json.dumps([(env, how) for env, how, _ in CASES])]], {})
    lines = [ln for ln in out.splitlines() if ln.startswith(("REFUSED", "EMBEDDED"))]
    assert len(lines) == len(CASES), out
    for (env, how, want), line in zip(CASES, lines):
        assert line.startswith(want), (env, how, line)
        if want == "REFUSED":
            assert "distemb-launch" in line and "DISTEMB_CONFIG" in line, line


def test_gloo_group_of_two_refuses_private_tables():
    port = str(free_port())
    outs = _run(GLOO, [["0", port], ["1", port]], {})
    for out in outs:
        assert out.startswith("REFUSED"), out
        assert "torch.distributed group of 2" in out, out
