"""Run untrusted Python (model-written code) in a sandboxed subprocess: the layer below ``rewards`` (the code
reward's tests) and ``envs`` (the Python tool).

``run_python(code, config=SandboxConfig(...))`` runs a program and returns a ``SandboxResult`` (its output, exit
status and the isolation ``layers`` that held); ``probe`` / ``startup_check`` say which layers this host gives and
raise ``SandboxUnavailable`` when a required one is missing. One module per job: ``run.py`` (the host side: config,
plan, launch, result), ``_launcher.py`` (the script that builds the isolation and starts the program; read as
source, never imported), ``cgroups.py`` (per-run cgroups) and ``syscalls.py`` (the seccomp allow-list). It imports
nothing else of the package.
"""

from gspo_mcore.sandbox.run import (
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    probe,
    run_python,
    startup_check,
)

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailable", "probe", "run_python", "startup_check"]
