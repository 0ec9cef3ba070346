"""Transports: framed messages between processes (tcp default, mpi), shm for co-located
data, and the all-to-all rounds of a collective job over torch.distributed
(:mod:`distemb.transport.collective`, which imports torch)."""
