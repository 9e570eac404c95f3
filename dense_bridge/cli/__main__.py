"""``python -m dense_bridge.cli``: the same command line as the ``dense-bridge`` script."""
import sys

from ._main import main

sys.exit(main())
