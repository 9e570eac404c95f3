"""The ``dense-bridge`` command line and its demo, built on the public API."""
from ._main import main

__all__ = ["main"]
