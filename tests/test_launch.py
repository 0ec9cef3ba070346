"""distemb-launch: ip_config parsing, the cluster config, dry runs and failure handling."""
import json
import sys

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
