"""``python -m kvj.demo``: the crash-and-recover demo with its defaults, as the quick start runs
it (``kvj demo`` takes --out, --seed and --device)."""

import sys

from kvj.demo.run import demo
from kvj.errors import InvalidArgument

if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(f"python -m kvj.demo: error: takes no options; run kvj demo {' '.join(sys.argv[1:])}", file=sys.stderr)
        sys.exit(64)
    try:
        sys.exit(0 if demo() else 1)
    except InvalidArgument as exc:
        print(f"python -m kvj.demo: error: {exc}", file=sys.stderr)
        sys.exit(64)
