"""Servers served by threads of the test process, so a test can make a store fail or
stall where it runs: ``serving(cfg)`` serves every server of ``cfg`` until the block ends.

Example:
    >>> with serving(parse_cluster_config(cluster_dict(1, shared_memory=True))) as stops:
    ...     pass  # clients of the config talk to it; stops[0] is set at its last goodbye
"""
import contextlib
import threading

from distemb.server import build_service
from distemb.stores.dense import DenseStore
from distemb.transport import tcp
from distemb.transport.connections import local_address


@contextlib.contextmanager
def serving(cfg):
    """Serve every server of ``cfg`` on threads; yields the event each sets when every
    trainer has said goodbye (set by the block's end too)."""
    stops, threads, services = [], [], []
    try:
        for sid in range(len(cfg.servers)):
            stop = threading.Event()
            service = build_service(cfg, sid, stop)
            stops.append(stop)
            services.append(service)
            listeners = [tcp.listen_local(local_address(cfg, sid)),
                         tcp.listen(cfg.servers[sid].host, cfg.servers[sid].port)]
            thread = threading.Thread(target=tcp.serve,
                                      args=(listeners, service.handle, stop),
                                      kwargs={"timeout": cfg.timeout_s}, daemon=True)
            thread.start()
            threads.append(thread)
        yield stops
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(10)
        for service in services:
            service.server.close()
            service.arena.close()


#: What an update answered early then failed by fail_updates() is raised as.
FAILED = r"server 0: the update of 't' answered early then failed: no room"


def fail_updates(monkeypatch):
    """Make every update of a dense store (of servers served here) fail, after its
    checks: as a full disk or memory would."""
    def broken(*args, **kw):
        raise MemoryError("no room for the update")
    monkeypatch.setattr(DenseStore, "update", broken)


def stall_updates(monkeypatch, request, wait_s=20):
    """Make every update of a dense store wait (at most ``wait_s``) until the returned
    event is set; the test's end sets it before its clients close."""
    release = threading.Event()
    request.addfinalizer(release.set)
    update = DenseStore.update

    def stuck(*args, **kw):
        release.wait(wait_s)
        return update(*args, **kw)
    monkeypatch.setattr(DenseStore, "update", stuck)
    return release
