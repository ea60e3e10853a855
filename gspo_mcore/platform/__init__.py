"""Adapters of third-party libraries to the host (see megatron_cpu)."""
