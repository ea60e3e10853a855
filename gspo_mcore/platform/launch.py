"""Starting processes on this host: a free local port, and the ``torch.distributed.run`` command prefix."""

from __future__ import annotations

import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual bind-to-0 trick: racy, but fine for local launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_prefix(nproc: int) -> list[str]:
    """The command that starts ``nproc`` ranks on this host with ``torch.distributed.run`` on a free port
    (append ``-m module ...`` or a script path and its arguments)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]
