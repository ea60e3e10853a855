"""tools/slurm/gspo_mcore.sbatch under a real Slurm: a single-node cluster on this machine (slurmctld and slurmd on
localhost, auth/none and cred/none, so no munge), the tiny job submitted with ``sbatch`` as one node and one task
running torchrun with ``--nproc_per_node 2`` for 2 steps, then its metrics file checked.

Slurm comes from Debian's ``slurm-wlm`` 22.05 packages: installed (``slurmctld`` on PATH), or unpacked with
``dpkg -x`` into a folder named by ``GSPO_SLURM_ROOT`` (``apt-get download slurmctld slurmd slurm-client
slurm-wlm-basic-plugins libmunge2 libhwloc15``, then ``dpkg -x`` each). Without either the test is skipped, and
with ``GSPO_SLURM_TESTS=1`` (for a CI that installs the packages) it fails instead."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _slurm() -> dict | None:
    """Paths of the Slurm programs: ``{bin, sbin suffix, plugins, lib}``, or None when Slurm is not at hand."""
    root = os.environ.get("GSPO_SLURM_ROOT")
    if root:
        r = Path(root)
        lib = r / "usr/lib/x86_64-linux-gnu"
        return {
            "bin": r / "usr/bin",
            "slurmctld": r / "usr/sbin/slurmctld-wlm",
            "slurmd": r / "usr/sbin/slurmd-wlm",
            "slurmstepd": r / "usr/sbin/slurmstepd-wlm",
            "plugins": lib / "slurm-wlm",
            "ld": f"{lib}:{lib / 'slurm-wlm'}",
        }
    ctld = shutil.which("slurmctld")
    if ctld is None:
        return None
    sbin = Path(ctld).parent
    plugins = next(Path("/usr/lib").glob("*/slurm-wlm"), None) or Path("/usr/lib/slurm")
    return {
        "bin": Path(shutil.which("sbatch") or "/usr/bin/sbatch").parent,
        "slurmctld": Path(ctld),
        "slurmd": sbin / "slurmd",
        "slurmstepd": sbin / "slurmstepd",
        "plugins": plugins,
        "ld": "",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM = _slurm()
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        SLURM is None and os.environ.get("GSPO_SLURM_TESTS") != "1",
        reason="no Slurm here (install Debian's slurm-wlm, or set GSPO_SLURM_ROOT to its unpacked .debs)",
    ),
]


def test_the_tiny_job_runs_under_a_single_node_slurm(tmp_path):
    assert SLURM is not None, "GSPO_SLURM_TESTS=1 but Slurm is missing: install slurm-wlm or set GSPO_SLURM_ROOT"
    assert os.geteuid() == 0, "the single-node cluster runs as root (SlurmUser=root)"
    from helpers.launch import prepare_tiny

    cpus = os.cpu_count() or 2
    for d in ("state", "spool"):
        (tmp_path / d).mkdir()
    conf = tmp_path / "slurm.conf"
    ctld_port, d_port = _free_port(), _free_port()
    conf.write_text(
        f"""ClusterName=gspo
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
StateSaveLocation={tmp_path}/state
SlurmdSpoolDir={tmp_path}/spool
SlurmctldPidFile={tmp_path}/slurmctld.pid
SlurmdPidFile={tmp_path}/slurmd.pid
PluginDir={SLURM["plugins"]}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
NodeName=localhost CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    # slurmd 22.05 always starts a cgroup plugin; on a cgroup-v2 host without systemd it needs these
    (tmp_path / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\nIgnoreSystemdOnFailure=yes\n")
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=f"{SLURM['bin']}:{os.environ['PATH']}")
    if SLURM["ld"]:
        env["LD_LIBRARY_PATH"] = SLURM["ld"] + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    daemons = []
    try:
        for cmd, log in (
            ([SLURM["slurmctld"], "-D", "-c", "-f", conf], "slurmctld.log"),
            ([SLURM["slurmd"], "-D", "-N", "localhost", "-f", conf, "-d", SLURM["slurmstepd"]], "slurmd.log"),
        ):
            with open(tmp_path / log, "wb") as out:
                daemons.append(
                    subprocess.Popen(
                        [str(c) for c in cmd], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            time.sleep(2)
        for _ in range(30):
            idle = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if "idle" in idle:
                break
            time.sleep(1)
        assert "idle" in idle, (tmp_path / "slurmd.log").read_text()[-2000:]

        prepare_tiny(tmp_path, 32)
        out = tmp_path / "run"
        job_env = dict(
            env,
            GSPO_CONFIG="examples/tiny/config.yaml",
            GSPO_GPUS_PER_NODE="2",
            GSPO_PYTHON=sys.executable,
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
            MASTER_PORT=str(_free_port()),
            GSPO_OVERRIDES=(
                f"steps=2 model.hf_dir={tmp_path}/model data.paths=[{tmp_path}/prompts.jsonl] log.output_dir={out} "
                "rollout.prompts_per_step=4 rollout.group_size=2 log.progress_bar=false"
            ),
        )
        log = tmp_path / "job.out"
        proc = subprocess.run(
            ["sbatch", "--wait", "--nodes=1", "--ntasks=1", f"--output={log}", "tools/slurm/gspo_mcore.sbatch"],
            cwd=ROOT,
            env=job_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, f"{proc.stderr}\n{log.read_text()[-4000:] if log.exists() else ''}"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
    finally:
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
