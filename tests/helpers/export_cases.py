"""The real training checkpoints the export tests train and export (tests/convert/train_export_worker.py).

A constant shared by ``tests/convert/conftest.py`` (which trains them) and the test modules (which name their
cases): imported by module name, ``from helpers.export_cases import TRAINED``, never through ``conftest``
(a bare ``from conftest import`` takes whichever ``conftest`` module pytest imported first).
"""

from __future__ import annotations

TRAINED = [
    ("dense", "tp2", dict(tp=2)),
    ("dense", "pp2-distopt", dict(pp=2, distopt=True)),
    ("dense", "dp2-distopt", dict(distopt=True)),
    ("moe", "ep2", dict(ep=2)),
    ("moe", "ep2-distopt-full", dict(ep=2, distopt=True, format="fully_reshardable")),
]
"""``(model, layout, options)``. Each is a run folder ``<root>/<model>-<layout>`` whose ``checkpoints/step_0``
the trainer's Checkpointer wrote after one GSPO batch. Expert-TP is absent: MoE with TP > 1 needs sequence
parallelism (a GPU), and expert-TP alone fails in the token dispatcher's sequence-parallel gather over gloo on
this CPU setup."""
