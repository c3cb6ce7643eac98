"""Cube: the sharded sparse-parameter key-value service (docs/ARCHITECTURE.md)."""

import os

# gRPC's fork handlers make fork() wait for every thread that is inside gRPC, while the thread
# that forks holds the GIL, which those threads need to finish: a process that starts a
# subprocess while another of its threads makes calls can hang forever (grpcio 1.85; seen in
# the test harness: a helm upgrade run while lookups ran, stuck in the pre-fork handler where
# no timeout could reach it). Every process of ours that forks execs at once, which needs no
# fork support; a program that set the variable keeps its choice.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
