"""The entry point the multi-rank test workers share (tests/learner, tests/convert,
tests/checkpoint). A worker runs a JSON list of cases on every rank and rank 0 writes one JSON line per case.

    def run_case(case: dict, args) -> dict: ...
    if __name__ == "__main__":
        run_cases(run_case, {"--ref": "folder of the 1-rank reference results"})
"""

from __future__ import annotations

import argparse
import json


def run_cases(run_case, paths: dict[str, str], *, append: bool = False) -> None:
    """Parse ``--cases`` (JSON list), ``--out`` (JSON-lines, rank 0) and the folder options in ``paths``
    (option -> help), run ``run_case(case, args)`` for every case, write the results, destroy the groups.
    ``append``: write each result as soon as its case is done, appending to ``--out``."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of cases")
    parser.add_argument("--out", required=True, help="JSON-lines result file (written by rank 0)")
    for option, text in paths.items():
        parser.add_argument(option, required=True, help=text)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gspo_mcore.learner.parallel import destroy_parallel

    results = []
    for case in json.loads(args.cases):
        results.append(run_case(case, args))
        if append and dist.get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    if not append and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    destroy_parallel()
