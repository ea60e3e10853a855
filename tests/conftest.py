"""Shared fixtures for the ops / algo tests.

- ``backend``: runs a test through the pure-torch twins (``"reference"``) and through the compiled CPU
  kernels under every instruction set this CPU supports (``"avx512_bf16"``, ``"avx512"``, ``"avx2"``,
  ``"default"``).
- ``cpu_isa``: the compiled kernels under each supported instruction set only.
- ``compiled`` / ``reference``: force one side with :func:`gspo_mcore.ops.use_reference`.
- ``error_report``: tests record measured error figures; they are printed in the terminal summary.

Every fixture that changes global state (the ISA, the op backend) restores it afterwards.
"""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import _backend

if _backend.HAVE_EXTENSION:
    from gspo_mcore import _C

    SUPPORTED_ISAS = list(_C.supported_cpu_isas())
else:  # pragma: no cover - only without the extension
    _C = None
    SUPPORTED_ISAS = []

_NO_EXT = pytest.mark.skip(reason=f"gspo_mcore._C is not available: {_backend.IMPORT_ERROR}")
_ISA_PARAMS = [pytest.param(isa, id=isa) for isa in SUPPORTED_ISAS] or [pytest.param(None, marks=_NO_EXT)]


_SEEDED_MODULES = ("test_ops_", "test_algo_", "test_tp_")


@pytest.fixture(autouse=True)
def _seed(request):
    """Every ops / algo test starts from the same torch random state, so failures reproduce (other test
    packages under tests/ are left alone)."""
    if request.module.__name__.rpartition(".")[2].startswith(_SEEDED_MODULES):
        torch.manual_seed(0)


def _set_isa(name):
    used = _C.set_cpu_isa(name)
    assert name == "auto" or used == name, (name, used)


@pytest.fixture(params=_ISA_PARAMS)
def cpu_isa(request):
    """The compiled CPU kernels forced to one instruction set (restored to 'auto' afterwards)."""
    _set_isa(request.param)
    try:
        with ops.use_reference(False):
            yield request.param
    finally:
        _set_isa("auto")


@pytest.fixture(params=[pytest.param("reference", id="reference")] + _ISA_PARAMS)
def backend(request):
    """'reference' (pure-torch twins) or the compiled kernels under one CPU instruction set."""
    if request.param == "reference":
        with ops.use_reference(True):
            yield "reference"
        return
    _set_isa(request.param)
    try:
        with ops.use_reference(False):
            yield request.param
    finally:
        _set_isa("auto")


@pytest.fixture
def compiled():
    if not _backend.HAVE_EXTENSION:
        pytest.skip(f"gspo_mcore._C is not available: {_backend.IMPORT_ERROR}")
    with ops.use_reference(False):
        yield


@pytest.fixture
def reference():
    with ops.use_reference(True):
        yield


@pytest.fixture(params=["reference", "compiled"])
def impl(request):
    """The algorithm layer run on the reference twins and on the compiled ops."""
    if request.param == "compiled" and not _backend.HAVE_EXTENSION:
        pytest.skip(f"gspo_mcore._C is not available: {_backend.IMPORT_ERROR}")
    with ops.use_reference(request.param == "reference"):
        yield request.param


def pytest_configure(config):
    config._gspo_errors = {}


@pytest.fixture
def error_report(request):
    """``report(key, kernel_err, eager_err, floor=0, use=None)``: keeps, per key, the worst kernel error,
    the worst eager error and the worst use of the bound (``kernel / (2 * eager + floor)`` unless the test
    passes its own ``use``) seen by any test. A use above 1 fails the calling test here (AssertionError)."""
    store = request.config._gspo_errors

    def report(key, kernel_err, eager_err, floor=0.0, use=None):
        k, e, worst = store.get(key, (0.0, 0.0, 0.0))
        bound = 2 * eager_err + floor
        this_use = use if use is not None else (kernel_err / bound if bound > 0 else 0.0)
        store[key] = (max(k, float(kernel_err)), max(e, float(eager_err)), max(worst, float(this_use)))
        assert this_use <= 1.0, (
            f"{key}: error {float(kernel_err):.3e} uses {float(this_use):.2f} of its bound "
            f"(eager {float(eager_err):.3e}, floor {float(floor):.3e})"
        )

    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    store = getattr(config, "_gspo_errors", {})
    if not store:
        return
    terminalreporter.section("gspo_mcore measured errors vs float64 (max over cases)")
    terminalreporter.write_line(
        "impl: the compiled kernels or the reference twin, as tagged; eager: eager torch "
        "(float32 unless tagged 'eager-in-<dtype>'); bound use: impl / bound (fails > 1)"
    )
    terminalreporter.write_line(f"{'quantity':<72} {'impl':>10} {'eager':>10} {'bound use':>10}")
    for key in sorted(store):
        k, e, use = store[key]
        terminalreporter.write_line(f"{key:<72} {k:>10.3e} {e:>10.3e} {use:>10.2f}")
