"""The compiled SPMD program (chapter 16): minidist's dp x tp training step written once in pure JAX,
``shard_map`` over a device mesh and ``jax.jit`` (program.py), and that mesh (mesh.py)."""

from minidist.parallel.spmd.mesh import _jax, default_shape, global_array, make_mesh, mesh_devices  # noqa: F401
from minidist.parallel.spmd.program import SPMDProgram, collective_counts, local_loss, ring_all_reduce  # noqa: F401
