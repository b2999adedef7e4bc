"""The parallel layer (JAX only): meshes, strategies, partitioning of the step, layouts, the plan."""
