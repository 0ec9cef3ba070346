"""distemb-launch: start the servers and trainers of one job from a DGL ip_config.

``distemb-launch --ip-config ip.txt --num-servers S --num-trainers T -- python train.py``

``ip.txt`` has DGL's format: one ``IP [port]`` per machine, ``#`` comments. S servers and
T trainers run on every machine (DGL's per-machine counts); server ``k`` of machine ``m``
listens on ``port + k`` (port default 30050) and has id ``m * S + k``; trainer ranks are
``m * T + k``. The launcher writes ONE validated cluster config (JSON; by default into a
fresh private temporary directory, removed when the job ends; ``--config-out PATH`` on a
shared file system for a job on several machines) and gives every process its path in
``$DISTEMB_CONFIG`` with ``$DISTEMB_ROLE``/``$DISTEMB_RANK``;
trainers also get ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` so
dense layers can use ``torch.distributed`` (DDP).

Launchers: ``local`` (every address must be loopback; all processes start here), ``ssh``
(one ``ssh HOST 'cd DIR && ENV... python -m distemb.session_guard CMD'`` per process;
the config path must be on a shared file system) and ``mpirun`` (ranks < S*machines are
servers, the rest trainers). ``--dry-run`` prints the exact commands. If a process fails,
or on Ctrl-C, every child is stopped by PID. If the launcher itself dies, even by SIGKILL,
the kernel stops its local children (Linux parent-death signal), servers also notice they
were orphaned, and each remote process's guard reads end-of-file on its ssh session and
stops it. Shared memory is memory files that die with the processes (no /dev/shm files). Every
line a child writes is prefixed with its role and rank (``[server0]: ``, ``[trainer1]: ``).
The config carries a fresh job token: a process outside the job cannot join it.

Example::

    distemb-launch --ip-config ip.txt --num-servers 2 --num-trainers 2 -- python train.py
"""
import argparse
import hashlib
import ipaddress
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import uuid

from distemb.config import (ClusterConfig, load_cluster_config, parse_cluster_config,
                            write_cluster_config)
from distemb.enums import Choice, Consistency, Role, Transport
from distemb.errors import ConfigError, DistEmbError
from distemb.partition import load_policies
from distemb.schema import default_of, help_of
from distemb.supervisor import Supervisor

DEFAULT_PORT = 30050


class Launcher(Choice):
    """How distemb-launch starts the processes of a job."""

    # Every process starts on this machine; every ip_config address must be loopback.
    LOCAL = "local"
    # One 'ssh HOST cd DIR && ENV... CMD' per process; the config on a shared file system.
    SSH = "ssh"
    # One mpirun; ranks below the server count become servers, the rest trainers (MPI).
    MPIRUN = "mpirun"


def read_ip_config(path):
    """Machines of a DGL ip_config file.

    Returns:
        list of (ip, port or None), one per machine.

    Raises:
        ConfigError: ``path:line: ...`` naming the bad line and what was expected.
    """
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such ip_config file")
    machines = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{path}:{n}"
            if len(words) > 2:
                raise ConfigError(f"{where}: expected 'IP [port]', got {line.strip()!r}")
            try:
                ip = str(ipaddress.ip_address(words[0]))
            except ValueError:
                raise ConfigError(f"{where}: {words[0]!r} is not an IP address "
                                  f"(expected 'IP [port]')") from None
            port = None
            if len(words) == 2:
                if not words[1].isdigit() or not 0 < int(words[1]) < 65536:
                    raise ConfigError(f"{where}: port must be 1..65535, got {words[1]!r}")
                port = int(words[1])
            machines.append((ip, port))
    if not machines:
        raise ConfigError(f"{path}: no machines listed")
    return machines


def build_config(machines, num_servers, num_trainers, part_config=None, job_token=None,
                 port_offset=0, **options):
    """The cluster config of S servers and T trainers per machine.

    Args:
        machines: (ip, port or None) per machine, as :func:`read_ip_config` returns.
        num_servers, num_trainers: per machine.
        part_config: a DGL partition config or distemb policy file, or None.
        job_token: the job's token (default: a fresh one). Processes that each build the
            config themselves (under DGL's launcher) pass the same token: the job id is
            then derived from it, so every process writes the same config.
        port_offset: server ``k`` of machine ``m`` listens on ``port_m + port_offset + k``
            (DGL's own servers hold ``port_m + k``).
        options: other :class:`~distemb.config.ClusterConfig` fields (``transport``,
            ``consistency``, ``shared_memory``, ``timeout_s``, ``master_port``, ...);
            a field left out takes its declared default.

    Raises:
        ConfigError: invalid counts or options, or a partition config whose partitions
            cannot be spread over the servers.
    """
    for what, v in (("--num-servers", num_servers), ("--num-trainers", num_trainers)):
        if v < 1:
            raise ConfigError(f"{what}: must be >= 1, got {v}")
    servers = [{"host": ip, "port": (port or DEFAULT_PORT) + port_offset + k, "machine": m}
               for m, (ip, port) in enumerate(machines) for k in range(num_servers)]
    if part_config:
        parts = {p.num_partitions for p in load_policies(part_config).values()}
        total = len(servers)
        if any(p % total for p in parts):
            raise ConfigError(f"--part-config {part_config}: {sorted(parts)} partition(s) do "
                              f"not match {total} server(s) ({len(machines)} machine(s) x "
                              f"{num_servers}): partition p lives on server p % servers, so "
                              f"the partition count must be a multiple of the server count")
    if job_token is None:
        job_id, job_token = uuid.uuid4().hex[:12], secrets.token_hex(16)
    else:
        job_id = hashlib.sha256(f"distemb-job:{job_token}".encode()).hexdigest()[:12]
    return parse_cluster_config({
        "job_id": job_id, "job_token": job_token,
        "servers": servers,
        "num_trainers": num_trainers * len(machines),
        "trainer_machines": [m for m in range(len(machines)) for _ in range(num_trainers)],
        "master_addr": machines[0][0], "part_config": part_config,
        **{k: v.value if isinstance(v, Choice) else v for k, v in options.items()}})


def cache_options(args):
    """The ``cache`` mapping of the --cache-* options (None when no size is given)."""
    sizes = {k: v for k, v in (("rows", args.cache_rows), ("bytes", args.cache_bytes),
                               ("fraction", args.cache_fraction)) if v is not None}
    if not sizes:
        return None
    return dict(sizes, policy=args.cache_policy, staleness=args.cache_staleness,
                idle_when_slower=not args.cache_keep_when_slower)


def device_cache_options(args):
    """The ``device_cache`` mapping of the --device-cache-* options (None without a size)."""
    sizes = {k: v for k, v in (("rows", args.device_cache_rows),
                               ("bytes", args.device_cache_bytes),
                               ("fraction", args.device_cache_fraction)) if v is not None}
    return dict(sizes, policy=args.device_cache_policy) if sizes else None


def server_env(cfg_path, sid):
    return {"DISTEMB_CONFIG": cfg_path, "DISTEMB_ROLE": Role.SERVER.value,
            "DISTEMB_RANK": str(sid)}


def trainer_env(cfg, cfg_path, rank):
    local = rank - cfg.trainer_machines.index(cfg.trainer_machines[rank])
    return {"DISTEMB_CONFIG": cfg_path, "DISTEMB_ROLE": Role.TRAINER.value,
            "DISTEMB_RANK": str(rank),
            "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(cfg.master_port),
            "RANK": str(rank), "WORLD_SIZE": str(cfg.num_trainers), "LOCAL_RANK": str(local)}


def server_cmd(python, cfg_path, sid):
    return [python, "-m", "distemb.server", "--config", cfg_path, "--server-id", str(sid)]


def plan(cfg, cfg_path, command, python):
    """Every process of the job: list of (host, env, argv), servers first."""
    procs = [(s.host, server_env(cfg_path, i), server_cmd(python, cfg_path, i))
             for i, s in enumerate(cfg.servers)]
    hosts = {s.machine: s.host for s in cfg.servers}
    procs += [(hosts[m], trainer_env(cfg, cfg_path, r), list(command))
              for r, m in enumerate(cfg.trainer_machines)]
    return procs


def ssh_argv(host, env, argv, cwd, python=sys.executable):
    """The ssh command starting ``argv`` with ``env`` in ``cwd`` on ``host``, under
    :mod:`distemb.session_guard`: the remote process dies when its ssh session does."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    guard = [python, "-m", "distemb.session_guard"]
    remote = f"cd {shlex.quote(cwd)} && {exports} {shlex.join(guard + list(argv))}"
    return ["ssh", "-o", "StrictHostKeyChecking=no", host, remote]


def mpirun_argv(cfg, cfg_path, command, python):
    """One mpirun whose ranks become servers (rank < servers) or trainers."""
    n = len(cfg.servers) + cfg.num_trainers
    return ["mpirun", "--oversubscribe", "-np", str(n), python, "-m", "distemb.launch",
            "--mpi-child", cfg_path, "--", *command]


def mpi_child(cfg_path, command):
    """Inside mpirun: become this rank's server or trainer (exec, so MPI is set up once)."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1")))
    if rank < 0:
        raise DistEmbError("--mpi-child: no MPI rank in the environment (run under mpirun)")
    cfg = load_cluster_config(cfg_path)
    num_servers = len(cfg.servers)
    if rank < num_servers:
        os.environ.update(server_env(cfg_path, rank))
        argv = server_cmd(sys.executable, cfg_path, rank)
    else:
        os.environ.update(trainer_env(cfg, cfg_path, rank - num_servers))
        argv = list(command)
    os.execvp(argv[0], argv)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default after its help (where
    there is one and the help does not say it already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in text):
            text += f" (default: {action.default})"
        return text


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="distemb-launch", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--ip-config", help="DGL ip_config: one 'IP [port]' per machine")
    parser.add_argument("--num-servers", type=int, default=1, help="servers per machine")
    parser.add_argument("--num-trainers", type=int, default=1, help="trainers per machine")
    parser.add_argument("--part-config", help="DGL partition config or distemb policy file")
    parser.add_argument("--launcher", choices=Launcher.values(), default=Launcher.LOCAL.value,
                        help="how the processes start: here, over ssh, or by one mpirun")
    parser.add_argument("--transport", choices=Transport.values(),
                        help=f"default: {Transport.MPI} under --launcher {Launcher.MPIRUN}, "
                        f"else {default_of(ClusterConfig, 'transport')}")
    parser.add_argument("--consistency", choices=Consistency.values(),
                        default=default_of(ClusterConfig, "consistency").value,
                        help=help_of(ClusterConfig, "consistency"))
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="pull every row over the transport, even from local servers")
    parser.add_argument("--cache-rows", type=int, help="trainer cache: rows per table")
    parser.add_argument("--cache-bytes", type=int, help="trainer cache: bytes per table "
                        "(rows and their optimizer state)")
    parser.add_argument("--cache-fraction", type=float,
                        help="trainer cache: a fraction of each table's rows")
    parser.add_argument("--cache-policy", choices=("lru", "lfu"), default="lru",
                        help="trainer cache: which row it evicts")
    parser.add_argument("--cache-staleness", type=int, default=0,
                        help="0: exact cache (default); s > 0: rows up to s steps old")
    parser.add_argument("--cache-keep-when-slower", action="store_true",
                        help="trainer cache: keep caching even where its pulls and updates "
                             "take longer than plain ones (by default it goes idle there)")
    parser.add_argument("--device-cache-rows", type=int,
                        help="GPU cache of each table's hot rows (one trainer only): rows")
    parser.add_argument("--device-cache-bytes", type=int,
                        help="GPU cache: bytes per table (rows and their optimizer state)")
    parser.add_argument("--device-cache-fraction", type=float,
                        help="GPU cache: a fraction of each table's rows")
    parser.add_argument("--device-cache-policy", choices=("lru", "lfu"), default="lru",
                        help="GPU cache: which row it evicts")
    parser.add_argument("--timeout", type=float, default=default_of(ClusterConfig, "timeout_s"),
                        help=help_of(ClusterConfig, "timeout_s"))
    parser.add_argument("--idle-timeout", type=float,
                        default=default_of(ClusterConfig, "idle_timeout_s"),
                        help=help_of(ClusterConfig, "idle_timeout_s"))
    parser.add_argument("--master-port", type=int,
                        default=default_of(ClusterConfig, "master_port"),
                        help=help_of(ClusterConfig, "master_port"))
    parser.add_argument("--config-out", metavar="PATH",
                        help="where to write the cluster config, which holds the job's "
                        "token (owner-only). Default: cluster.json in a fresh private "
                        f"directory under {tempfile.gettempdir()} ($TMPDIR), removed when "
                        "the job ends (kept after --dry-run). Required when the ip_config "
                        "names other machines: a path on a file system they all read")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--mpi-child", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- trainer command")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("missing the trainer command after '--'")
    if not args.mpi_child and not args.ip_config:
        parser.error("--ip-config is required")
    return args


def run(args):
    """Write the config and start (or print) the job. Returns the exit code."""
    if args.mpi_child:
        mpi_child(args.mpi_child, args.command)
    machines = read_ip_config(args.ip_config)
    launcher = Launcher(args.launcher)
    transport = args.transport or (Transport.MPI if launcher == Launcher.MPIRUN
                                   else default_of(ClusterConfig, "transport"))
    cfg = build_config(machines, args.num_servers, args.num_trainers, args.part_config,
                       transport=transport, consistency=args.consistency,
                       shared_memory=not args.no_shared_memory, timeout_s=args.timeout,
                       master_port=args.master_port, idle_timeout_s=args.idle_timeout,
                       cache=cache_options(args), device_cache=device_cache_options(args))
    if launcher == Launcher.LOCAL:
        bad = [ip for ip, _ in machines if not ipaddress.ip_address(ip).is_loopback]
        if bad:
            raise ConfigError(f"{args.ip_config}: --launcher local runs everything on this "
                              f"machine, but {bad[0]} is not a loopback address (use ssh)")
    run_dir = None
    if args.config_out:
        cfg_path = os.path.abspath(args.config_out)
    else:
        remote = [ip for ip, _ in machines if not ipaddress.ip_address(ip).is_loopback]
        if remote:
            raise ConfigError(f"--config-out: the job runs on other machines ({remote[0]} "
                              "is not a loopback address), which read its cluster config: "
                              "give --config-out PATH on a file system they all share")
        run_dir = tempfile.mkdtemp(prefix="distemb-job-")  # private: mode 0700
        cfg_path = os.path.join(run_dir, "cluster.json")
    try:
        write_cluster_config(cfg, cfg_path)
        if args.dry_run and run_dir:
            print(f"# cluster config: {cfg_path} (delete it when done)", file=sys.stderr)
            run_dir = None  # the printed commands read it
        return _start(args, cfg, cfg_path, launcher)
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _start(args, cfg, cfg_path, launcher):
    """Start (or print) the processes of the job. Returns the exit code."""
    python = sys.executable
    if launcher == Launcher.MPIRUN:
        commands = [mpirun_argv(cfg, cfg_path, args.command, python)]
    elif launcher == Launcher.SSH:
        commands = [ssh_argv(h, env, argv, os.getcwd())
                    for h, env, argv in plan(cfg, cfg_path, args.command, python)]
    else:
        commands = None
    if args.dry_run:
        for h, env, argv in ([] if commands else plan(cfg, cfg_path, args.command, python)):
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        for argv in commands or []:
            print(shlex.join(argv))
        return 0
    sup = Supervisor()
    try:
        if commands and launcher == Launcher.MPIRUN:
            sup.start(commands[0], {}, server=False, label="mpirun")
        else:
            for i, (h, env, argv) in enumerate(plan(cfg, cfg_path, args.command, python)):
                server = i < len(cfg.servers)
                label = f"{env['DISTEMB_ROLE']}{env['DISTEMB_RANK']}"
                sup.start(ssh_argv(h, env, argv, os.getcwd()) if commands else argv, env,
                          server, label, ssh=bool(commands))
        sup.relay_output()
        return sup.watch()
    except KeyboardInterrupt:
        print("distemb-launch: interrupted; stopping every process", file=sys.stderr)
        sup.stop_all()
        return 130
    finally:
        sup.drain_output()


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the children like Ctrl-C does


def main(argv=None):
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        return run(parse_args(argv))
    except DistEmbError as e:
        print(f"distemb-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
