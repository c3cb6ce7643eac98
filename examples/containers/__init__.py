"""The Helm chart's pods in real containers (podman), end to end: `python -m
examples.containers.demo`; tests/test_containers.py runs the same scenario."""
