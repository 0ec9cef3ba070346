"""Caches of hot rows in front of a client: the trainer cache
(:mod:`~distemb.kvstore.caches.trainer`, rows validated by version against their
servers) and the GPU cache (:mod:`~distemb.kvstore.caches.device`, the one writer of the
rows it holds), sharing their per-table bookkeeping
(:mod:`~distemb.kvstore.caches.table`)."""
