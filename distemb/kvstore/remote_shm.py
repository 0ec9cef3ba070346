"""The shared-memory paths of a trainer to the servers on its machine.

A mixin of :class:`~distemb.kvstore.remote.RemoteKVClient` (it uses that client's
connections, request slots, mapped shards and its one ``_call``): reads of co-located
shards straight from their memory files (never torn: the seqlock, and beside an update
answered early, :class:`~distemb.kvstore.server.early.Applying`), and updates and pushes
handed over in the trainer's request slot (docs/cluster.md, "Transports").

Example (a trainer on the machine of server 0, under ``distemb-launch``)::

    client = RemoteKVClient(load_cluster_config(os.environ["DISTEMB_CONFIG"]), rank=0)
    client.init_data("emb", (1000, 16), "float32", range_policy(1000, 1))
    client._shm[("emb", 0)].array.shape     # the shard, mapped read-only: (1000, 16)
    client.pull("emb", np.arange(10))       # gathered from it, no round trip
"""
import numpy as np

from distemb import kernels
from distemb.kernels import half
from distemb.transport.base import MAX_FDS
from distemb.transport.messages import InShm, Service, ShmInfo
from distemb.transport.shm import attach_all


class SharedMemoryPaths:
    """Request slots out, mapped shards in (see the module docstring)."""

    def _frame_for(self, sid, msg, wait):
        """The frame of ``msg``; an update or push to a co-located server goes through
        its request slot (the frame carries the slot's descriptor when it is new).

        Only when the reply is awaited: the slot is reused by the next request, so the
        server must be done with it first (asynchronous updates travel in the frame).
        """
        frame = msg.encode()
        slot = self._slots.get(sid) if wait else None
        if slot is None or frame.service not in (Service.UPDATE, Service.PUSH):
            return frame
        layout = slot.write(frame.arrays)
        out = InShm(name=frame.name, flags=frame.flags, service=frame.service,
                    fields=frame.fields, size=slot.size, layout=layout).encode()
        fd = slot.take_fd()
        if fd is not None:
            out.fds.append(fd)
        return out

    def _map_shm(self, name, by):
        """Map the shards of ``name`` that servers on this machine hold in shared memory."""
        local = {sid: parts for sid, parts in by.items() if sid in self._local}
        for at in range(0, max(map(len, local.values()), default=0), MAX_FDS):
            asked = {sid: p[at:at + MAX_FDS] for sid, p in local.items() if p[at:at + MAX_FDS]}
            fds = {}

            def take(sid, frame):
                fds[sid] = frame.fds[:]
                frame.fds.clear()
            replies = self._call({sid: ShmInfo(name=name, parts=parts)
                                  for sid, parts in asked.items()}, on_reply=take)
            for sid, reply in replies.items():
                f = reply.fields
                shards = attach_all(fds[sid], f["segments"], f["shapes"],
                                    [half.storage_dtype(dt) for dt in f["dtypes"]],
                                    f.get("files"))
                self._shm.update({(name, part): shard for part, shard in zip(asked[sid], shards)
                                  if shard is not None})

    def _gather(self, shard, local, sid, name, part):
        """Rows ``local`` of a mapped shard of ``name`` (server ``sid``'s), never torn;
        None if writes kept it busy. Beside this trainer's update of it that the server
        answered early, while it is applied (:class:`~distemb.kvstore.server.early.Applying`)."""
        rows = self._applying.gather(sid, name, part, shard, local, self._copy_rows)
        return rows if rows is not None else \
            shard.read(lambda a: self._copy_rows(a, local))

    def _copy_rows(self, a, local):
        if a.dtype == np.float32 and a.ndim == 2:
            return kernels.gather_rows(a, local, None, self.num_threads)
        if half.is_half(half.dtype_name(a)):  # decoded in the gather
            return half.gather_rows(a, local, None, self.num_threads)
        return a[local]

    def _sum_buffer(self, name, n, dim):
        """With the whole table on one co-located server (a keyed table: one server in
        all): a buffer in its request slot.

        The summed gradients are then handed to the server where they were summed, with
        no copy (``push_update`` follows ``coalesce`` before any other request).
        """
        sids = list(self._shards(name))
        slot = self._slots.get(sids[0]) if len(sids) == 1 else None
        if slot is None:
            return super()._sum_buffer(name, n, dim)
        return slot.view((max(n, 1), dim), np.float32)
