"""Learner tests: distributed ones spawn gloo ranks with ``torch.distributed.run`` (see learner_launch)."""

from __future__ import annotations


def pytest_configure(config):
    config._learner_invariance = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = getattr(config, "_learner_invariance", [])
    if not rows:
        return
    terminalreporter.section("learner aggregation invariance vs 1 rank (2 mini-batch updates)")
    terminalreporter.write_line(
        f"{'layout':<22} {'ranks':>5} {'mb/rank':>7} {'loss[1]':>12} {'grad norm[0]':>12} "
        f"{'|dloss|':>9} {'|dgnorm|':>9} {'max|dparam|':>11} {'|dlogp|':>9} "
        f"{'|dgrad|/max|g|':>14} {'worst dgrad/bound':>17}"
    )
    for r in rows:
        dloss = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
        dgn = max(abs(a - b) for a, b in zip(r["grad_norms"], r["ref_grad_norms"]))
        grad = f"{r['grad_rel']:.2e}" if "grad_rel" in r else "-"
        bound = f"{r['grad_bound_ratio']:.3f}" if "grad_bound_ratio" in r else "-"
        terminalreporter.write_line(
            f"{r['case']:<22} {r['world']:>5} {max(r['num_microbatches']):>7.0f} {r['losses'][1]:>12.7f} "
            f"{r['grad_norms'][0]:>12.7f} {dloss:>9.2e} {dgn:>9.2e} {r['param_diff']:>11.2e} {r['logp_diff']:>9.2e} "
            f"{grad:>14} {bound:>17}"
        )
