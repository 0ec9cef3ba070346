"""RemoteKVClient: the KVClient of a trainer whose tables live in server processes.

Partition ``p`` of every table belongs to server ``p % num_servers``. Each request is
split by owning server and sent to all of them before any reply is read, so servers work
concurrently; an update costs one round trip per server per step (the optimizer has
already deduplicated and coalesced the rows). With shared memory on, rows of shards whose
server runs on this trainer's machine are gathered straight from /dev/shm (no round
trip); writes still go to the owning server, the only writer of its rows.

``init_data`` and ``init_optimizer`` are collective, as in DGL: every trainer calls them
in the same order (DistEmbedding/optimizer construction does), the first creator's
initial values win, and they return once every trainer has the table.

Example (servers started by ``distemb-launch``)::

    client = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    client.init_data("emb", (1000, 16), "float32", range_policy(1000, client.num_servers))
    rows = client.pull("emb", np.arange(10))
"""
import numpy as np

from distemb import kernels
from distemb.enums import Consistency, Transport
from distemb.errors import KVStoreError, PartitionError, TransportError
from distemb.kvstore.types import DataMeta, KVClient
from distemb.kvstore.local import init_shard
from distemb.rules import RULES, state_name
from distemb.transport import tcp
from distemb.transport.base import FLAG_NO_REPLY
from distemb.transport.messages import (Barrier, Bye, Create, Drop, Hello, OptInit, Pull,
                                        Push, Reply, Service, ShmInfo, Update)
from distemb.transport.shm import attach

INIT_CHUNK_BYTES = 64 << 20
ERRORS = {"PartitionError": PartitionError}


def open_connections(cfg):
    """One connection per server of ``cfg``, over its transport.

    Raises:
        ServerUnavailableError: a TCP server cannot be reached within ``cfg.timeout_s``.
    """
    if cfg.transport == Transport.MPI:
        # mpi4py is an optional extra, and importing it initialises MPI: only under mpirun.
        from distemb.transport import mpi
        return mpi.connect_all(len(cfg.servers), cfg.timeout_s, cfg.max_message_bytes)
    return [tcp.connect(s.host, s.port, cfg.timeout_s, cfg.max_message_bytes,
                        peer=f"server {i} ({s.host}:{s.port})")
            for i, s in enumerate(cfg.servers)]


class RemoteKVClient(KVClient):
    """KVClient over a cluster of KVStore servers.

    Args:
        cfg: the job's :class:`~distemb.config.ClusterConfig`.
        rank: this trainer's rank (0..num_trainers-1).
        consistency: a :class:`~distemb.enums.Consistency` or its value (default:
            ``cfg.consistency``); all trainers of a job must use the same.
        connections: one :class:`~distemb.transport.base.Connection` per server (default:
            :func:`open_connections`).
        num_threads: OpenMP threads of shared-memory gathers.

    Raises:
        ServerUnavailableError: a server cannot be reached within ``cfg.timeout_s``.
    """

    def __init__(self, cfg, rank, connections=None, num_threads=1, consistency=None):
        if not 0 <= rank < cfg.num_trainers:
            raise KVStoreError(f"rank: expected 0..{cfg.num_trainers - 1}, got {rank}")
        self.cfg, self.rank, self.num_threads = cfg, rank, num_threads
        self.num_servers = len(cfg.servers)
        self.consistency = Consistency.parse(consistency or cfg.consistency, "consistency",
                                             KVStoreError)
        self._conns = list(connections) if connections is not None else open_connections(cfg)
        self._meta, self._shm, self._seq = {}, {}, {}
        self._closed = False
        self.server_info = [r.fields for r in self._call(
            {sid: Hello(rank=rank) for sid in range(self.num_servers)}).values()]
        for sid, info in enumerate(self.server_info):
            if info.get("server_id") != sid or info.get("num_servers") != self.num_servers:
                raise KVStoreError(f"server {sid}: answers as server {info.get('server_id')} "
                                   f"of {info.get('num_servers')}, the config lists "
                                   f"{self.num_servers} servers")
        machine = cfg.trainer_machines[rank]
        self._local = {sid for sid, s in enumerate(cfg.servers) if cfg.shared_memory
                       and s.machine == machine and self.server_info[sid].get("shared_memory")}

    # -- plumbing -----------------------------------------------------------------------

    def _call(self, requests, wait=True):
        """Send ``{server id: message}`` to all, then read every reply.

        Returns:
            {server id: Reply}.

        Raises:
            KVStoreError: a server answered with an error (after all replies were read).
            ServerUnavailableError: a server died or timed out.
        """
        if self._closed:
            raise KVStoreError("this RemoteKVClient is closed")
        for sid, msg in requests.items():
            if not wait:
                msg.flags |= FLAG_NO_REPLY
            self._conns[sid].send(msg.encode())
        if not wait:
            return {}
        replies, failed = {}, []
        for sid in requests:
            frame = self._conns[sid].recv()
            if frame.service == Service.ERROR:
                failed.append((frame.fields.get("kind"), str(frame.fields.get("message"))))
            elif frame.service != Service.REPLY:
                raise TransportError(f"server {sid}: unexpected reply service {frame.service}")
            else:
                replies[sid] = Reply.decode(frame)
        if failed:
            kind, message = failed[0]
            raise ERRORS.get(kind, KVStoreError)(message)
        return replies

    def _parts_by_server(self, policy):
        by = {}
        for part in range(policy.num_partitions):
            by.setdefault(part % self.num_servers, []).append(part)
        return by

    def _route(self, name, ids, skip_shm=False):
        """Split ``ids`` of ``name`` by server.

        Returns:
            ({sid: (parts, counts, local ids, positions)}, [(part, positions, local ids)]
            of the parts read from shared memory when ``skip_shm``).
        """
        by, shm = {}, []
        for part, pos, local in self._meta[name].policy.split(ids):
            sid = part % self.num_servers
            if skip_shm and (name, part) in self._shm:
                shm.append((part, pos, local))
                continue
            by.setdefault(sid, []).append((part, pos, local))
        routes = {sid: ([p for p, _, _ in g], [len(lo) for _, _, lo in g],
                        np.concatenate([lo for _, _, lo in g]).astype(np.int64, copy=False),
                        np.concatenate([pos for _, pos, _ in g]))
                  for sid, g in by.items()}
        return routes, shm

    # -- KVClient -----------------------------------------------------------------------

    def init_data(self, name, shape, dtype, policy, init_func=None):
        if name in self._meta:
            raise KVStoreError(f"name {name!r} already exists in the KVStore")
        by = self._parts_by_server(policy)
        replies = self._call({sid: Create(name=name, dtype=dtype, row_shape=list(shape[1:]),
                                          parts=parts, part_rows=[policy.get_part_size(p)
                                                                  for p in parts])
                              for sid, parts in by.items()})
        self._meta[name] = DataMeta(tuple(shape), dtype, policy)
        if init_func is not None:
            for sid, parts in by.items():
                for part in set(parts) - set(replies[sid].fields["existed"]):
                    self._init_shard(name, sid, part, policy, init_func, shape, dtype)
        self.barrier()
        self._map_shm(name, by)

    def _init_shard(self, name, sid, part, policy, init_func, shape, dtype):
        sshape = (policy.get_part_size(part),) + tuple(shape[1:])
        arr = init_shard(init_func, sshape, dtype, name)
        step = max(1, INIT_CHUNK_BYTES // max(1, arr[:1].nbytes))
        for s in range(0, sshape[0], step):
            chunk = arr[s:s + step]
            self._call({sid: Push(name=name, parts=[part], counts=[len(chunk)],
                                  ids=np.arange(s, s + len(chunk), dtype=np.int64),
                                  values=chunk)})

    def _map_shm(self, name, by):
        local = {sid: parts for sid, parts in by.items() if sid in self._local}
        if not local:
            return
        for sid, reply in self._call({sid: ShmInfo(name=name, parts=parts)
                                      for sid, parts in local.items()}).items():
            f = reply.fields
            for part, path, shp, dt in zip(local[sid], f["paths"], f["shapes"], f["dtypes"]):
                if path:
                    self._shm[(name, part)] = attach(path, tuple(shp), dt)

    def delete_data(self, name):
        meta = self._meta.pop(name, None)
        if meta is None:
            return
        for key in [k for k in self._shm if k[0] == name]:
            del self._shm[key]
        self._call({sid: Drop(name=name) for sid in self._parts_by_server(meta.policy)})

    def pull(self, name, ids):
        meta = self._meta_of(name)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        meta.policy.check_ids(ids, f"ids of {name!r}")
        whole = self._shm.get((name, 0)) if meta.policy.num_partitions == 1 else None
        if whole is not None:  # one co-located shard: local ids are global ids
            return self._gather(whole, ids)
        out = np.empty((len(ids),) + meta.shape[1:], dtype=meta.dtype)
        routes, shm = self._route(name, ids, skip_shm=bool(self._shm))
        requests = {sid: Pull(name=name, parts=r[0], counts=r[1], ids=r[2])
                    for sid, r in routes.items()}
        for sid, msg in requests.items():  # remote rows travel while local ones are copied
            self._conns[sid].send(msg.encode())
        for part, pos, local in shm:
            out[pos] = self._gather(self._shm[(name, part)], local)
        failed = []
        for sid in requests:  # read every reply, even after an error, to stay in step
            frame = self._conns[sid].recv()
            if frame.service == Service.ERROR:
                failed.append(str(frame.fields.get("message")))
            elif len(frame.arrays) != 1 or frame.arrays[0].shape != (len(routes[sid][2]),) \
                    + meta.shape[1:]:
                failed.append(f"server {sid}: pull reply of the wrong shape")
            else:
                out[routes[sid][3]] = frame.arrays[0]
        if failed:
            raise KVStoreError(failed[0])
        return out

    def _gather(self, shard, local):
        if shard.dtype == np.float32 and shard.ndim == 2:
            return kernels.gather_rows(shard, local, None, self.num_threads)
        return shard[local]

    def push(self, name, ids, values):
        meta = self._meta_of(name)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        meta.policy.check_ids(ids, f"ids of {name!r}")
        values = np.ascontiguousarray(values, dtype=meta.dtype).reshape(
            (len(ids),) + meta.shape[1:])
        routes, _ = self._route(name, ids)
        self._call({sid: Push(name=name, parts=r[0], counts=r[1], ids=r[2],
                              values=values[r[3]]) for sid, r in routes.items()})

    def init_optimizer(self, name, rule, options):
        meta = self._meta_of(name)
        if rule not in RULES:
            raise KVStoreError(f"rule: expected one of {sorted(RULES)}, got {rule!r}")
        opts = {k: float(v) for k, v in options.items()}
        # Collective: everyone is here before rank 0 resets the state, and nobody steps
        # before it has (a fresh optimizer starts from fresh state, as torch's does).
        self.barrier()
        if self.rank == 0:
            self._call({sid: OptInit(name=name, rule=rule, options=opts, parts=parts)
                        for sid, parts in self._parts_by_server(meta.policy).items()})
        self.barrier()
        names = {}
        for spec in RULES[rule].states:
            sname = state_name(name, spec.name)
            self._meta[sname] = DataMeta((meta.shape[0],) + spec.shape(meta.shape[1]),
                                         spec.dtype, meta.policy)
            names[spec.name] = sname
        self._seq[name] = 0
        return names

    def push_update(self, name, ids, grads, rule, hyper):
        meta = self._meta_of(name)
        routes, _ = self._route(name, np.ascontiguousarray(ids, dtype=np.int64))
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        hyper = {k: (v if isinstance(v, int) else float(v)) for k, v in hyper.items()}
        exact = self.consistency == Consistency.SYNC_EXACT
        requests = {sid: Update(name=name, rule=rule, hyper=hyper, seq=seq, exact=exact,
                                parts=r[0], counts=r[1], ids=r[2], grads=grads[r[3]])
                    for sid, r in routes.items()}
        if exact:
            # Every owning server hears from every trainer each step, even with no rows,
            # so it knows when the step's contributions are complete.
            for sid in self._parts_by_server(meta.policy):
                requests.setdefault(sid, Update(
                    name=name, rule=rule, hyper=hyper, seq=seq, exact=True, parts=[], counts=[],
                    ids=np.empty(0, np.int64),
                    grads=np.empty((0, grads.shape[1]), np.float32)))
        self._call(requests, wait=self.consistency != Consistency.ASYNC)

    @property
    def needs_every_step(self):
        return self.consistency == Consistency.SYNC_EXACT

    def barrier(self):
        if self.cfg.num_trainers > 1:
            self._call({0: Barrier(rank=self.rank)})

    def close(self, goodbye=True):
        """Disconnect; with ``goodbye``, first tell every server this trainer is done.

        Servers exit once every trainer has said goodbye. Tables stay on the servers.
        """
        if self._closed:
            return
        try:
            if goodbye:
                self._call({sid: Bye(rank=self.rank) for sid in range(self.num_servers)})
        except TransportError:
            pass  # a server already gone needs no goodbye
        finally:
            self._closed = True
            self._shm.clear()
            for conn in self._conns:
                conn.close()
