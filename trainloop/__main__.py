"""``python -m trainloop``: the same command line as the ``trainloop`` script."""

import sys

from trainloop.cli import main

if __name__ == "__main__":
    sys.exit(main())
