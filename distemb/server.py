"""The KVStore server process: ``python -m distemb.server --config C --server-id N``.

Holds the shards of the partitions it owns (p % num_servers == N) with the numpy backend
only (this module and everything it imports never import torch), serves the protocol of
:mod:`distemb.transport.messages` over the configured transport, and exits 0 once every
trainer has said goodbye, on SIGTERM/SIGINT/SIGHUP, or when its parent process (the
launcher) is gone; told to stop by a signal or its parent's death, it exits within
:data:`STOP_GRACE_S` seconds even if its shutdown hangs (printing every thread's stack
first); its shutdown done, it leaves at once (:func:`leave`), without the interpreter's
finalization, which no deadline can bound. If its Python is stuck and can act on neither,
its reaper, a small process forked at its start, SIGKILLs it :data:`REAP_AFTER_S` seconds
after its parent's death. With shared memory on it also listens on its
local socket, where the trainers of its machine connect; its shards are memory files
that vanish with the last process mapping them, so nothing of the job outlives its
processes, however they die.

Example (normally started by ``distemb-launch``)::

    python -m distemb.server --config cluster.json --server-id 0
"""
import argparse
import faulthandler
import logging
import os
import resource
import signal
import sys
import threading
import time

from distemb.config import default_num_threads, load_cluster_config
from distemb.enums import Transport
from distemb.errors import DistEmbError
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.server.service import KVService
from distemb.orphans import start_reaper
from distemb.transport import tcp
from distemb.transport.connections import local_address
from distemb.transport.shm import ShmArena

PARENT_POLL_S = 0.5
#: Told to stop by a signal or its parent's death, a server has this long to shut down
#: cleanly (answers under way, file tables flushed); then it prints every thread's stack
#: and exits anyway (status 3), so a hang in shutdown never leaves it running.
STOP_GRACE_S = 5.0
#: A server still running this long after its parent's death, its grace included, is
#: SIGKILLed by its reaper (:func:`distemb.orphans.start_reaper`): its Python is stuck.
REAP_AFTER_S = STOP_GRACE_S + 2.0


def build_service(cfg, server_id, stop):
    """The KVService of server ``server_id`` of ``cfg``; ``stop`` is set on the last BYE."""
    # Shared memory reaches trainers over the local socket of the TCP transport (under
    # MPI, co-located ranks exchange frames through MPI's own shared memory).
    arena = ShmArena(cfg.job_id, server_id) if cfg.shared_memory and \
        cfg.transport == Transport.TCP else None
    return KVService(KVServer(server_id, default_num_threads()), server_id, len(cfg.servers),
                     cfg.num_trainers, cfg.timeout_s, arena, stop.set, token=cfg.job_token,
                     max_request_bytes=cfg.max_message_bytes)


def stop_within(stop, grace):
    """The function that sets ``stop`` and starts the deadline: ``grace`` s later the
    process prints its threads' stacks to stderr and exits, whatever still runs (a
    shutdown that hangs: a completed update is in its shared memory or files already).
    It only sets events, so it may be a signal handler."""
    told = threading.Event()

    def deadline():
        told.wait()
        time.sleep(grace)
        try:
            print(f"distemb server: still running {grace:g} s after it was told to stop; "
                  f"exiting (its threads follow)", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
        except (OSError, ValueError):
            pass  # no stderr left (the launcher is gone): exit all the same
        os._exit(3)

    threading.Thread(target=deadline, name="distemb-stop-deadline", daemon=True).start()

    def now(*_):
        stop.set()
        told.set()
    return now


def watch_parent(stop, parent, told):
    """Call ``told()`` (which sets ``stop``) once the parent process ``parent`` is gone
    (we were reparented).

    The launcher also asks the kernel for SIGTERM on its death (PR_SET_PDEATHSIG); this
    covers servers started any other way, and a parent that died before that took hold.
    """
    def loop():
        while not stop.wait(PARENT_POLL_S):
            if os.getppid() != parent:
                told()  # first: the message may fail (stderr was the parent's pipe)
                try:
                    print(f"distemb server: parent process {parent} is gone; stopping",
                          file=sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass
    threading.Thread(target=loop, name="distemb-parent-watch", daemon=True).start()


def run(cfg, server_id):
    """Serve until every trainer said BYE or a signal arrives.

    Raises:
        DistEmbError: the server id is out of range or the port cannot be bound.
    """
    if not 0 <= server_id < len(cfg.servers):
        raise DistEmbError(f"--server-id: expected 0..{len(cfg.servers) - 1}, got {server_id}")
    if cfg.transport != Transport.MPI:  # (mpirun ends its ranks itself)
        start_reaper(REAP_AFTER_S)  # first: before any thread or descriptor of the server
    stop = threading.Event()
    told = stop_within(stop, STOP_GRACE_S)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, told)
    watch_parent(stop, os.getppid(), told)
    # A descriptor per shared-memory shard: allow as many as the hard limit does.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    service = build_service(cfg, server_id, stop)
    try:
        if cfg.transport == Transport.MPI:
            from distemb.transport import mpi  # mpi4py is an optional extra
            mpi.serve(service.handle, stop)
        else:
            entry = cfg.servers[server_id]
            # The local socket first: a server that answers on TCP answers there too.
            listeners = [tcp.listen_local(local_address(cfg, server_id))] \
                if service.arena else []
            listeners.append(tcp.listen(entry.host, entry.port))
            tcp.serve(listeners, service.handle, stop, cfg.max_message_bytes,
                      timeout=cfg.timeout_s, idle_timeout=cfg.idle_timeout_s)
    finally:
        service.server.close()  # file-backed tables flush and unlock their directories
        if service.arena:
            service.arena.close()


def leave(status):
    """End the process with ``status`` now that its shutdown is done: stdio and log
    handlers flushed, then ``os._exit``, skipping the interpreter's finalization (garbage
    collection, module teardown): finalization runs after daemon threads stop, the stop
    deadline's among them, so nothing would bound a server slow or stuck there (under
    load one was seen there 3 s after its launcher's death). A server of an MPI job
    exits the normal way: MPI finalizes at interpreter exit."""
    if "mpi4py.MPI" in sys.modules:
        sys.exit(status)
    for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except (OSError, ValueError):
            pass  # no stdout or stderr left (the launcher is gone): exit all the same
    os._exit(status)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m distemb.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="cluster config (JSON)")
    parser.add_argument("--server-id", type=int, required=True, help="index in servers")
    args = parser.parse_args(argv)
    try:
        run(load_cluster_config(args.config), args.server_id)
    except DistEmbError as e:
        print(f"distemb server {args.server_id}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    leave(main())
