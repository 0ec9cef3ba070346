"""The connections of a trainer to its job's servers, over the job's transport.

A server on the trainer's machine is reached over its local socket when shared memory is
on (:func:`~distemb.transport.tcp.local_address`): that connection hands shared memory
over as file descriptors (:mod:`distemb.transport.shm`). Every other server is reached
over TCP (or MPI, under mpirun).

Example (servers started by ``distemb-launch``)::

    conns = open_connections(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
"""
from distemb.enums import Transport
from distemb.transport import tcp


def open_connections(cfg, rank=None):
    """One connection per server of ``cfg``, over its transport.

    Args:
        rank: the trainer's rank: with shared memory on, a server on its machine is
            reached over its local socket (:func:`~distemb.transport.tcp.local_address`),
            which hands over shared memory. None: TCP to every server.

    Raises:
        ServerUnavailableError: a TCP server cannot be reached within ``cfg.timeout_s``.
    """
    if cfg.transport == Transport.MPI:
        # mpi4py is an optional extra, and importing it initialises MPI: only under mpirun.
        from distemb.transport import mpi
        return mpi.connect_all(len(cfg.servers), cfg.timeout_s, cfg.max_message_bytes)
    machine = None if rank is None else cfg.trainer_machines[rank]
    return [tcp.connect(s.host, s.port, cfg.timeout_s, cfg.max_message_bytes,
                        peer=f"server {i} ({s.host}:{s.port})",
                        local=local_address(cfg, i) if cfg.shared_memory and
                        s.machine == machine else None)
            for i, s in enumerate(cfg.servers)]


def local_address(cfg, server_id):
    """The local socket of server ``server_id`` of ``cfg`` (see
    :func:`~distemb.transport.tcp.local_address`)."""
    return tcp.local_address(cfg.job_token or cfg.job_id, cfg.servers[server_id].port,
                             server_id)
