"""cube-server: serves shard files over gRPC (fast API, the original's API, control plane)."""
