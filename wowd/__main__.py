"""``python -m wowd``: the ``wowd`` command line (:mod:`wowd.cli`)."""

import sys

from wowd.cli import main

if __name__ == "__main__":
    sys.exit(main())
