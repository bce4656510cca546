"""`python -m attnres_conformance ...`: the same command line as the `attnres-conformance` script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
