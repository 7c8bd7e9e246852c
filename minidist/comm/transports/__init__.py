"""Transports: how one rank's messages reach another -- threads, MPI, shared memory, JAX devices, and
an emulated link."""
