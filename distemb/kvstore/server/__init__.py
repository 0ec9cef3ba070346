"""The server side of the KVStore: the shards a process holds and the requests on them.

:class:`~distemb.kvstore.server.kvserver.KVServer` holds one
:class:`~distemb.kvstore.server.shard.ShardTable` per shard; a server process answers the
wire protocol with a :class:`~distemb.kvstore.server.service.KVService` (its tables'
creation, optimizer state, checkpoints and keys in the
:class:`~distemb.kvstore.server.catalog.Catalog`). Embedded and collective clients hold
a KVServer in their own process. Nothing here imports torch.
"""
from distemb.kvstore.server.kvserver import KVServer

__all__ = ["KVServer"]
