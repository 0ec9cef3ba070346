"""Transports: framed messages between processes (tcp default, mpi) and shm for co-located data."""
