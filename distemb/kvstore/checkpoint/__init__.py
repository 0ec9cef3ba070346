"""Checkpoints on disk: the one format every shard writes where it lives
(:mod:`~distemb.kvstore.checkpoint.snapshot`), in CRC-checked segments
(:mod:`~distemb.kvstore.checkpoint.segments`), listed by its manifest
(:mod:`~distemb.kvstore.checkpoint.manifest`); a chain of a full save and incremental
ones (:mod:`~distemb.kvstore.checkpoint.chain`), made of what changed in each shard
(:mod:`~distemb.kvstore.checkpoint.changes`); and the sinks of a hash table's evicted
rows (:mod:`~distemb.kvstore.checkpoint.sink`)."""
