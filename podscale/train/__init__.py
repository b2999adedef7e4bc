"""The training layer: trainer loop, data, checkpoints, eval, MLPerf logs, several hosts, precision."""
