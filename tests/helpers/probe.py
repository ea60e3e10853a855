"""Run a snippet in a fresh interpreter (for process-wide settings that cannot be undone) and read back the JSON
object it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def probe(code: str, env_name: str, env_value: str | None, timeout: float = 120) -> dict:
    """``code`` run with ``env_name`` set to ``env_value`` (``None``: unset) in the environment; its last stdout line
    parsed as JSON."""
    env = {k: v for k, v in os.environ.items() if k != env_name}
    if env_value is not None:
        env[env_name] = env_value
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
