"""Run ``tools/convert_mcore_to_hf.py``'s ``main`` for several argument lists in one process (each export
sets up and tears down its own process group), to pay for importing megatron once.

    python export_many.py '[["--run", "A", "--out", "B"], ["--mcore", "C", "--out", "D"]]'
Exits with the first non-zero status.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    spec = importlib.util.spec_from_file_location(
        "convert_mcore_to_hf", os.path.join(ROOT, "tools", "convert_mcore_to_hf.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for argv in json.loads(sys.argv[1]):
        rc = tool.main(argv)
        if rc != 0:
            print(f"export_many: {argv} exited {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":  # the checkpoint reader may re-import this module in a helper process
    sys.exit(main())
