"""Adapters of third-party libraries (megatron_cpu: a CPU-only host; megatron_checkpoint: synchronous saves) and
of this host (launch: free ports, the torchrun command)."""
