"""distemb-launch: ip_config parsing, the cluster config, dry runs and failure handling."""
import json
import os
import re
import shutil
import stat
import sys
import time

import pytest

from mp_helper import ProcessGroup, free_port

from distemb.config import ClusterConfig, load_cluster_config, parse_cluster_config
from distemb.enums import Consistency, Transport
from distemb.errors import ConfigError
from distemb.launch import build_config, main, parse_args, read_ip_config
from distemb.schema import default_of

pytestmark = pytest.mark.timeout(60)


def ip_file(tmp_path, text):
    p = tmp_path / "ip.txt"
    p.write_text(text)
    return str(p)


def test_ip_config_reads_dgl_format(tmp_path):
    path = ip_file(tmp_path, "# machines\n127.0.0.1 4000\n\n127.0.0.2   # default port\n")
    assert read_ip_config(path) == [("127.0.0.1", 4000), ("127.0.0.2", None)]


@pytest.mark.parametrize("text,match", [
    ("127.0.0.1 4000 extra\n", r"ip.txt:1: expected 'IP \[port\]'"),
    ("localhost\n", "'localhost' is not an IP address"),
    ("127.0.0.1\n127.0.0.1 99999\n", "ip.txt:2: port must be 1..65535, got '99999'"),
    ("# nothing\n", "no machines listed"),
])
def test_bad_ip_config_line_is_named(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        read_ip_config(ip_file(tmp_path, text))


def test_config_layout_servers_and_trainers_per_machine():
    cfg = build_config([("10.0.0.1", 5000), ("10.0.0.2", None)], 2, 3)
    assert [(s.host, s.port, s.machine) for s in cfg.servers] == [
        ("10.0.0.1", 5000, 0), ("10.0.0.1", 5001, 0), ("10.0.0.2", 30050, 1),
        ("10.0.0.2", 30051, 1)]
    assert cfg.num_trainers == 6 and cfg.trainer_machines == (0, 0, 0, 1, 1, 1)
    assert parse_cluster_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("field,value,match", [
    ("servers", [{"host": "127.0.0.1", "port": 70000, "machine": 0}],
     r"servers\[0\].port: must be <= 65535, got 70000"),
    ("consistency", "eventual", "consistency: must be one of"),
    ("trainer_machines", [0, 0], r"trainer_machines: must list one machine per trainer"),
    ("timeout_s", 0, "timeout_s: must be a number > 0"),
    ("bogus", 1, "bogus: unknown field"),
])
def test_cluster_config_errors_name_the_field(field, value, match):
    raw = build_config([("127.0.0.1", 4000)], 1, 1).to_dict()
    raw[field] = value
    with pytest.raises(ConfigError, match=match):
        parse_cluster_config(raw)


def test_cli_defaults_are_the_config_field_defaults(tmp_path):
    args = parse_args(["--ip-config", "ip.txt", "--", "python", "t.py"])
    assert args.timeout == default_of(ClusterConfig, "timeout_s")
    assert args.master_port == default_of(ClusterConfig, "master_port")
    assert args.consistency == default_of(ClusterConfig, "consistency").value
    assert args.transport is None  # chosen by the launcher: mpi under mpirun, else the default
    cfg = build_config([("127.0.0.1", 4000)], 1, 1)
    for name in ("transport", "consistency", "shared_memory", "timeout_s", "master_port"):
        assert getattr(cfg, name) == default_of(ClusterConfig, name), name
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--config-out",
          str(tmp_path / "c.json"), "--dry-run", "--", "python", "t.py"])
    written = load_cluster_config(str(tmp_path / "c.json"))
    assert (written.timeout_s, written.master_port, written.consistency, written.transport,
            written.shared_memory) == (cfg.timeout_s, cfg.master_port, cfg.consistency,
                                       cfg.transport, cfg.shared_memory)


def test_cli_options_reach_the_config(tmp_path):
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--config-out",
          str(tmp_path / "c.json"), "--timeout", "7.5", "--master-port", "29611",
          "--consistency", "async", "--no-shared-memory", "--transport", "mpi", "--dry-run",
          "--", "python", "t.py"])
    raw = json.loads((tmp_path / "c.json").read_text())
    assert (raw["timeout_s"], raw["master_port"], raw["consistency"], raw["transport"],
            raw["shared_memory"]) == (7.5, 29611, "async", "mpi", False)
    cfg = build_config([("127.0.0.1", 4000)], 1, 1, consistency=Consistency.SYNC_EXACT,
                       transport=Transport.MPI)
    assert cfg.consistency is Consistency.SYNC_EXACT and cfg.transport is Transport.MPI
    with pytest.raises(ConfigError, match=r"^timeout_s: must be a number > 0, got -1"):
        build_config([("127.0.0.1", 4000)], 1, 1, timeout_s=-1)


def test_device_cache_options_reach_the_config(tmp_path, capsys):
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--config-out",
          str(tmp_path / "c.json"), "--device-cache-fraction", "0.05",
          "--device-cache-policy", "lfu", "--dry-run", "--", "python", "t.py"])
    cfg = load_cluster_config(str(tmp_path / "c.json"))
    assert (cfg.device_cache.fraction, cfg.device_cache.policy.value) == (0.05, "lfu")
    assert cfg.cache is None
    code = main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--num-trainers", "2",
                 "--device-cache-rows", "100", "--config-out", str(tmp_path / "d.json"),
                 "--dry-run", "--", "python", "t.py"])
    assert code == 2 and "device_cache: a device cache writes rows back only at eviction" \
        in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()


def test_trainer_cache_options_reach_the_config(tmp_path):
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--config-out",
          str(tmp_path / "c.json"), "--cache-fraction", "0.1", "--cache-policy", "lfu",
          "--cache-staleness", "3", "--dry-run", "--", "python", "t.py"])
    cache = load_cluster_config(str(tmp_path / "c.json")).cache
    assert (cache.fraction, cache.policy.value, cache.staleness, cache.idle_when_slower) == \
        (0.1, "lfu", 3, True)
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--config-out",
          str(tmp_path / "d.json"), "--cache-rows", "10", "--cache-keep-when-slower",
          "--dry-run", "--", "python", "t.py"])
    assert load_cluster_config(str(tmp_path / "d.json")).cache.idle_when_slower is False


def test_partition_config_must_match_server_count(tmp_path):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"num_partitions": 3, "policies": [
        {"kind": "node", "type": "_N", "book": "hash", "num_ids": 30}]}))
    with pytest.raises(ConfigError, match=r"\[3\] partition\(s\) do not match 2 server\(s\)"):
        build_config([("127.0.0.1", 4000)], 2, 1, part_config=str(part))
    assert len(build_config([("127.0.0.1", 4000)], 3, 1, str(part)).servers) == 3


def test_dry_run_local_prints_every_process(tmp_path, capsys):
    out_cfg = tmp_path / "c.json"
    code = main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--num-servers", "2",
                 "--num-trainers", "2", "--config-out", str(out_cfg), "--dry-run", "--",
                 "python", "train.py", "--epochs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and len(lines) == 4
    assert "DISTEMB_ROLE=server DISTEMB_RANK=1" in lines[1] and "--server-id 1" in lines[1]
    assert "DISTEMB_RANK=1" in lines[3] and "RANK=1 WORLD_SIZE=2" in lines[3]
    assert lines[3].endswith("python train.py --epochs 1")
    assert load_cluster_config(str(out_cfg)).servers[1].port == 4101


def test_dry_run_ssh_prints_ssh_commands(tmp_path, capsys):
    main(["--ip-config", ip_file(tmp_path, "10.1.0.1\n10.1.0.2\n"), "--launcher", "ssh",
          "--config-out", str(tmp_path / "c.json"), "--dry-run", "--", "python", "t.py"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("ssh -o StrictHostKeyChecking=no 10.1.0.")
                                   for line in lines)
    assert "10.1.0.2" in lines[3] and "DISTEMB_RANK=1" in lines[3]


def test_dry_run_mpirun_maps_ranks(tmp_path, capsys):
    main(["--ip-config", ip_file(tmp_path, "127.0.0.1\n"), "--launcher", "mpirun",
          "--num-servers", "2", "--num-trainers", "2", "--config-out",
          str(tmp_path / "c.json"), "--dry-run", "--", "python", "t.py"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("mpirun --oversubscribe -np 4 ") and "--mpi-child" in line
    assert load_cluster_config(str(tmp_path / "c.json")).transport == "mpi"


def test_local_launcher_refuses_remote_addresses(tmp_path, capsys):
    code = main(["--ip-config", ip_file(tmp_path, "10.1.0.1\n"), "--config-out",
                 str(tmp_path / "c.json"), "--", "python", "t.py"])
    assert code == 2 and "10.1.0.1 is not a loopback address" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_crashed_trainer_stops_every_process(tmp_path):
    ip = ip_file(tmp_path, f"127.0.0.1 {free_port()}\n")
    crash = "import sys, time; sys.exit(3) if __import__('os').environ['RANK'] == '1' " \
            "else time.sleep(60)"
    with ProcessGroup() as group:
        group.spawn([sys.executable, "-m", "distemb.launch", "--ip-config", ip,
                     "--num-trainers", "2", "--config-out", str(tmp_path / "c.json"), "--",
                     sys.executable, "-c", crash], expect=3)
        out = next(iter(group.wait_all(30).values()))
    assert "exited with 3; stopping every process" in out


PROGRESS = """\
import os, sys, time
print(os.environ["DISTEMB_CONFIG"], os.path.exists(os.environ["DISTEMB_CONFIG"]), flush=True)
sys.stdout.write("progress 1/2")  # a progress bar's first state: no line end yet
sys.stdout.flush()
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stdout.write("\\rprogress 2/2\\n")
"""


def _launch_progress(tmp_path, group):
    """A 1 x 1 job from ``tmp_path`` (no --config-out) whose trainer writes a partial line
    and waits for the file ``go``; returns (launcher process, go)."""
    (tmp_path / "progress.py").write_text(PROGRESS)
    go = tmp_path / "go"
    ip = ip_file(tmp_path, f"127.0.0.1 {free_port()}\n")
    p = group.spawn([sys.executable, "-m", "distemb.launch", "--ip-config", ip, "--",
                     sys.executable, str(tmp_path / "progress.py"), str(go)], cwd=str(tmp_path))
    return p, go


def _read_until(p, marker, timeout):
    """Bytes of ``p``'s stdout read as they come, until ``marker`` is among them."""
    import select

    got, deadline = b"", time.monotonic() + timeout
    while marker not in got and time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.multiprocess
def test_output_is_forwarded_as_written_not_at_line_ends(tmp_path):
    """A trainer's partial line (a progress bar) reaches the launcher's output while the
    trainer still waits; a carriage return starts a prefixed line again."""
    with ProcessGroup() as group:
        p, go = _launch_progress(tmp_path, group)
        early = _read_until(p, b"[trainer0]: progress 1/2", timeout=45)
        go.touch()  # only now may the trainer end its line
        late = _read_until(p, b"progress 2/2\n", timeout=45)  # raw bytes: \r as written
        group.wait_all(60)
    assert b"[trainer0]: progress 1/2" in early, early
    assert b"progress 1/2\r[trainer0]: progress 2/2\n" in early + late, early + late


@pytest.mark.multiprocess
def test_the_cluster_config_is_private_to_the_job_not_in_the_current_directory(tmp_path):
    """Without --config-out the config (it holds the job's token) is in a private
    temporary directory while the job runs, and gone after it; the directory the
    launcher ran in gets nothing."""
    with ProcessGroup() as group:
        p, go = _launch_progress(tmp_path, group)
        go.touch()
        out = next(iter(group.wait_all(60).values()))
    path, existed = re.search(r"\[trainer0\]: (\S+) (True|False)", out).groups()
    assert existed == "True" and not path.startswith(str(tmp_path)), out
    assert not os.path.exists(os.path.dirname(path)), path  # removed with the job
    assert sorted(os.listdir(tmp_path)) == ["go", "ip.txt", "progress.py"]


def test_dry_run_keeps_the_private_config_it_prints(tmp_path, capsys):
    code = main(["--ip-config", ip_file(tmp_path, "127.0.0.1 4100\n"), "--dry-run", "--",
                 "python", "t.py"])
    captured = capsys.readouterr()
    path = re.search(r"# cluster config: (\S+)", captured.err).group(1)
    try:
        assert code == 0 and f"DISTEMB_CONFIG={path}" in captured.out
        assert load_cluster_config(path).job_token
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    finally:
        shutil.rmtree(os.path.dirname(path))


def test_several_machines_need_a_config_path_they_share(tmp_path, capsys):
    code = main(["--ip-config", ip_file(tmp_path, "10.1.0.1\n10.1.0.2\n"), "--launcher",
                 "ssh", "--dry-run", "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert code == 2 and "--config-out: the job runs on other machines (10.1.0.1" in err, err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("servers per machine (default: 1)", "(default: local)",
                 f"(default: {default_of(ClusterConfig, 'timeout_s')})",
                 "removed when the job ends"):
        assert text in out, text


def test_relays_keep_each_childs_lines_apart_and_prefixed():
    """Child 0 leaves a line unfinished (a progress bar), child 1 writes a line: child 0's
    line is ended first, and its next bytes start a new prefixed line."""
    import io
    import threading

    from distemb.supervisor import _relay

    out, lock, lines = io.BytesIO(), threading.Lock(), {}
    pipes = [os.pipe() for _ in range(2)]
    relays = [threading.Thread(target=_relay, args=(os.fdopen(r, "rb", buffering=0),
                                                    f"[c{i}]: ".encode(), out, lock, lines))
              for i, (r, _) in enumerate(pipes)]
    for t in relays:
        t.start()

    def write(i, data):
        os.write(pipes[i][1], data)
        deadline = time.monotonic() + 10
        while data not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)

    write(0, b" 10%")
    write(1, b"hello\n")
    write(0, b"\r 20%")
    write(0, b"\n")
    for _, w in pipes:
        os.close(w)
    for t in relays:
        t.join(10)
    assert out.getvalue() == b"[c0]:  10%\n[c1]: hello\n\r[c0]:  20%\n", out.getvalue()
