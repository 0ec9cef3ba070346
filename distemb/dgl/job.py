"""A job started by DGL's launcher gets distemb's servers without a second launcher.

DGL's ``tools/launch.py`` (or a test that starts ``DistGraphServer`` processes itself)
runs the user's script in server-role and trainer-role processes and tells them the job
through variables (``DGL_IP_CONFIG``, ``DGL_NUM_SERVER``, ``DGL_NUM_SAMPLER``,
``DGL_SERVER_ID``) and the ``DistGraphServer`` arguments. Under :func:`distemb.dgl.patch`:

- a DGL server process (``DistGraphServer.start``) also starts distemb's server, as a
  child process (``python -m distemb.server``, the public entry point), waits for it
  after DGL's server stops, and fails if it failed;
- a trainer (``dgl.distributed.initialize``) joins those servers as trainer ``rank``.

Both sides build the same cluster config from DGL's ip_config: distemb server ``k`` of
machine ``m`` listens on ``port_m + $DISTEMB_DGL_PORT_OFFSET + k`` (offset 1000 by
default; DGL's own servers hold ``port_m + k``), trainers are DGL's clients less its
sampler processes. In DGL's standalone mode nothing is started and tables are embedded.

The job token: every process of the job must hold the same ``$DISTEMB_JOB_TOKEN``.

- Processes that inherit one parent's environment (DGL's tests start their servers and
  trainers with ``multiprocessing`` from the test process) get it from :func:`patch
  <distemb.dgl.patch.patch>` in that parent: it makes a fresh token for its children
  (:func:`make_token_for_children`) when none is set. The parent itself cannot use it:
  a process that made the token serves or trains with it only after passing it on to
  a process it started.
- Processes started separately, as DGL's launcher starts them (through ssh, each
  running the script on its own), share no parent: the token must be given to each,
  e.g. with DGL's ``--extra_envs DISTEMB_JOB_TOKEN=<secret>``; without it they refuse
  to start, saying so. A token made by a process for its children never passes for
  such a process's own.

Example::

    python tools/launch.py --workspace $PWD --ip_config ip.txt --num_servers 1 \\
        --num_trainers 2 --part_config parts/g.json \\
        --extra_envs DISTEMB_JOB_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))') \\
        "python -m distemb.dgl.patch train.py"
"""
import atexit
import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import tempfile

from distemb import context as _context
from distemb.config import write_cluster_config
from distemb.errors import DistEmbError
from distemb.integrations.dgl import dgl
from distemb.launch import build_config, read_ip_config

TOKEN_VAR = "DISTEMB_JOB_TOKEN"
#: The pid of the process that made ``$DISTEMB_JOB_TOKEN`` for its children (unset when
#: the token was given).
TOKEN_MAKER_VAR = "DISTEMB_JOB_TOKEN_MADE_BY"
PORT_OFFSET_VAR = "DISTEMB_DGL_PORT_OFFSET"
DEFAULT_PORT_OFFSET = 1000
SERVER_EXIT_S = 30.0

log = logging.getLogger("distemb")

__all__ = ["TOKEN_VAR", "TOKEN_MAKER_VAR", "PORT_OFFSET_VAR", "job_token",
           "make_token_for_children", "dgl_cluster_config", "ServerBeside",
           "join_trainer", "leave", "is_distributed"]


def is_distributed():
    """True in DGL's distributed mode (``DGL_DIST_MODE=distributed``), as DGL decides."""
    return os.environ.get("DGL_DIST_MODE", "standalone") != "standalone"


def _int_var(name, default, signed=False):
    value = os.environ.get(name, str(default))
    if not (value[1:] if signed and value.startswith("-") else value).isdigit():
        raise DistEmbError(f"${name}: expected a{'n' if signed else ' non-negative'} "
                           f"integer, got {value!r}")
    return int(value)


def job_token():
    """The job's token, ``$DISTEMB_JOB_TOKEN``.

    A token this very process made for its children (:func:`make_token_for_children`)
    does not count: this process was started separately, so no other process of a job
    can hold it.

    Raises:
        DistEmbError: it is not set (the message says how to pass it through DGL's
            launcher).
    """
    token = os.environ.get(TOKEN_VAR, "")
    if not token or os.environ.get(TOKEN_MAKER_VAR) == str(os.getpid()):
        raise DistEmbError(
            f"${TOKEN_VAR} is not set: a job started by DGL's launcher needs a token shared "
            "by its servers and trainers, or no process could tell its job's servers from "
            "a stranger's. Pass one to every process, e.g. `python tools/launch.py ... "
            f"--extra_envs {TOKEN_VAR}=$(python -c 'import secrets; "
            "print(secrets.token_hex(16))') \"python train.py\"`")
    return token


def started_by_dgl_launcher():
    """True in a process DGL's launcher (or a DGL job script) gave its role
    (``$DGL_ROLE``): its peers were started separately."""
    return bool(os.environ.get("DGL_ROLE"))


def make_token_for_children():
    """Make a job token for the processes this one starts, when none is set.

    The token goes into this process's environment, which the processes it starts
    (``multiprocessing``, ``subprocess``) inherit: DGL's own tests start a job's servers
    and trainers that way, and they then share it. This process itself is marked as its
    maker (``$DISTEMB_JOB_TOKEN_MADE_BY``), so that :func:`job_token` still refuses it
    here. Nothing is made where a token is set, nor in a process of DGL's launcher
    (:func:`started_by_dgl_launcher`): its peers do not inherit from it.

    Returns:
        whether a token was made.
    """
    if os.environ.get(TOKEN_VAR) or started_by_dgl_launcher():
        return False
    os.environ[TOKEN_VAR] = secrets.token_hex(16)
    os.environ[TOKEN_MAKER_VAR] = str(os.getpid())
    return True


def dgl_cluster_config(ip_config, num_servers, num_trainers, trainer_machine=None,
                       rank=None):
    """The distemb cluster config of a DGL job.

    Args:
        ip_config: DGL's ip_config file (one ``IP [port]`` per machine).
        num_servers: DGL's servers per machine (distemb runs one beside each).
        num_trainers: trainers in the whole job (DGL's clients less its samplers).
        trainer_machine, rank: this trainer's machine as DGL found it, and its rank
            (shared memory is only used with servers of the same machine).

    Raises:
        ConfigError: a bad ip_config.
        DistEmbError: no ``$DISTEMB_JOB_TOKEN``, or trainers not spread evenly.
    """
    machines = read_ip_config(ip_config)
    if num_trainers < 1 or num_trainers % len(machines):
        raise DistEmbError(f"num_trainers: DGL's launcher runs the same number of trainers on "
                           f"each of the {len(machines)} machine(s) of {ip_config}, got "
                           f"{num_trainers} in all")
    cfg = build_config(machines, num_servers, num_trainers // len(machines),
                       job_token=job_token(),
                       port_offset=_int_var(PORT_OFFSET_VAR, DEFAULT_PORT_OFFSET, signed=True))
    if trainer_machine is not None:
        where = list(cfg.trainer_machines)
        where[rank] = trainer_machine
        cfg = dataclasses.replace(cfg, trainer_machines=tuple(where))
    return cfg


def _write_private(cfg):
    """Write ``cfg`` to a file of this process only, removed when the process exits."""
    fd, path = tempfile.mkstemp(prefix="distemb-dgl-", suffix=".json")
    os.close(fd)
    write_cluster_config(cfg, path)
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return path


class ServerBeside:
    """distemb's server process beside one DGL server (``DistGraphServer``).

    Args:
        server_id: DGL's server id (``machine * num_servers + k``): distemb's is the same.
        ip_config, num_servers, num_clients: the ``DistGraphServer`` arguments.

    Raises:
        DistEmbError: no job token, or a bad ip_config.

    Example::

        beside = ServerBeside(0, "ip.txt", 1, 2)   # starts python -m distemb.server
        ...                                        # DGL's server runs here
        beside.wait()                              # its exit code (0: every trainer left)
    """

    def __init__(self, server_id, ip_config, num_servers, num_clients):
        samplers = _int_var("DGL_NUM_SAMPLER", 0)
        cfg = dgl_cluster_config(ip_config, num_servers, num_clients // (1 + samplers))
        if not 0 <= server_id < len(cfg.servers):
            raise DistEmbError(f"server_id: expected 0..{len(cfg.servers) - 1}, got {server_id}")
        self.server_id = server_id
        self.port = cfg.servers[server_id].port
        self.path = _write_private(cfg)
        self.process = subprocess.Popen([sys.executable, "-m", "distemb.server", "--config",
                                         self.path, "--server-id", str(server_id)])
        log.info("distemb server %d of %d started beside DGL's server (pid %d, port %d)",
                 server_id, len(cfg.servers), self.process.pid, cfg.servers[server_id].port)

    def wait(self, timeout=SERVER_EXIT_S):
        """Wait for the server to exit (stopping it after ``timeout`` s); its exit code.

        It exits by itself once every trainer said goodbye; one still running after
        ``timeout`` seconds (a trainer that never closed) gets SIGTERM, by PID.
        """
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            return self.process.wait(SERVER_EXIT_S)


def join_trainer(ip_config):
    """Make this trainer's distemb context: joins the servers of DGL's job.

    Called after DGL's own ``initialize`` connected (its ``rpc`` knows the client count,
    this client's rank and machine). In standalone mode: the usual (embedded) context.

    Returns:
        the current :class:`~distemb.context.DistContext`.

    Raises:
        DistEmbError: no ``$DISTEMB_JOB_TOKEN``, or a rank outside the trainer count.
    """
    if not is_distributed():
        ctx = _context.current_context()
        log.info("distemb in DGL's standalone mode: %s", ctx)
        return ctx
    rpc = dgl.distributed.rpc
    trainers = rpc.get_num_client() // (1 + _int_var("DGL_NUM_SAMPLER", 0))
    # torch's launcher (which DGL's wraps the trainers in) numbers the trainers alone;
    # DGL's client ids also count sampler processes.
    world = os.environ.get("WORLD_SIZE", "")
    rank = int(os.environ["RANK"]) if world == str(trainers) and "RANK" in os.environ \
        else rpc.get_rank()
    if not 0 <= rank < trainers:
        raise DistEmbError(f"rank: DGL's client {rank} is not one of the job's {trainers} "
                           "trainers; set RANK and WORLD_SIZE (torch's launcher does)")
    servers = int(os.environ.get("DGL_NUM_SERVER", "1"))
    cfg = dgl_cluster_config(ip_config, servers, trainers, rpc.get_machine_id(), rank)
    # initialize() reads them; samplers DGL forked before this point do not inherit them.
    os.environ.update({"DISTEMB_CONFIG": _write_private(cfg), "DISTEMB_RANK": str(rank)})
    _context.shutdown()  # a context of an earlier initialize()/exit_client() round
    ctx = _context.initialize()
    atexit.register(leave)
    log.info("distemb trainer %d of %d joined DGL's job (%d server(s))", rank, trainers,
             ctx.num_servers)
    return ctx


def leave():
    """Close this trainer's distemb context (its servers see it leave). Idempotent."""
    atexit.unregister(leave)
    _context.shutdown()
