"""Key-value store: servers own shards; clients pull, push and push updates."""
from distemb.kvstore.local import LocalKVClient
from distemb.kvstore.remote import RemoteKVClient
from distemb.kvstore.server.kvserver import KVServer
from distemb.kvstore.types import DataMeta, KVClient

__all__ = ["KVClient", "KVServer", "LocalKVClient", "RemoteKVClient", "DataMeta"]
