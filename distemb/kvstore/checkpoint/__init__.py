"""Checkpoints on disk: the one format every shard writes where it lives
(:mod:`~distemb.kvstore.checkpoint.snapshot`), in CRC-checked segments
(:mod:`~distemb.kvstore.checkpoint.segments`)."""
