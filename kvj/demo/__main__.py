"""``python -m kvj.demo``: the crash-and-recover demo (see ``kvj.demo.run``)."""

import sys

from kvj.demo.run import main

if __name__ == "__main__":
    sys.exit(main())
