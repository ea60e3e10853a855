#!/usr/bin/env bash
# Slurm for the single-node Slurm test (tests/tools/test_slurm_cluster.py), without a system-wide install:
# downloads Debian bookworm's Slurm 22.05 packages with `apt-get download` into .slurm/debs/ (git-ignored) and
# unpacks each with `dpkg -x` into .slurm/root/, then prints that root (what GSPO_SLURM_ROOT takes). Nothing is
# installed or configured: the test starts slurmctld and slurmd from the unpacked tree with a slurm.conf of its own
# (auth/none and cred/none, so munge is never contacted; libmunge2 is there because the programs link it).
#
#   GSPO_SLURM_ROOT=$(tools/slurm/ci_slurm.sh) GSPO_SLURM_TESTS=1 make test      (what .ci/run does)
#
# Idempotent: a root unpacked from the same package list is reused as it is (a stamp file records the list).
# GSPO_SLURM_DIR puts the folder elsewhere (default: .slurm at the repository root). Progress goes to stderr,
# only the root's path to stdout. Needs apt-get and dpkg (Debian bookworm or a derivative with its archive).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${GSPO_SLURM_DIR:-$REPO/.slurm}"
# slurmctld, slurmd (+ slurmstepd), sbatch/sinfo/scontrol/srun, the plugins (auth_none, cred_none, ...), and the
# two libraries the programs link that a plain Debian image lacks
PKGS=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins libmunge2 libhwloc15)
ROOT="$DIR/root"
STAMP="$ROOT/.gspo-slurm-stamp"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "${PKGS[*]}" && -x "$ROOT/usr/sbin/slurmctld-wlm" ]]; then
    echo "$ROOT"
    exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
    { echo "ci_slurm.sh: apt-get and dpkg are needed (Debian bookworm's packages)" >&2; exit 2; }
mkdir -p "$DIR/debs"
cd "$DIR/debs"
missing=()
for p in "${PKGS[@]}"; do
    compgen -G "${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "ci_slurm.sh: apt-get download ${missing[*]}" >&2
    # a fresh image has no package lists yet: update them once, only when the download cannot find a package
    apt-get download "${missing[@]}" >&2 2>/dev/null || {
        apt-get update -qq >&2
        apt-get download "${missing[@]}" >&2
    }
fi
rm -rf "$ROOT.tmp"
mkdir -p "$ROOT.tmp"
for p in "${PKGS[@]}"; do
    for deb in "${p}"_*.deb; do
        dpkg -x "$deb" "$ROOT.tmp"
    done
done
echo "${PKGS[*]}" >"$ROOT.tmp/.gspo-slurm-stamp"
rm -rf "$ROOT"
mv "$ROOT.tmp" "$ROOT"
echo "ci_slurm.sh: Slurm unpacked in $ROOT" >&2
echo "$ROOT"
