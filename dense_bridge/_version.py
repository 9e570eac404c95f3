"""The package version, in a module of its own so that modules inside the package can read it
without importing ``dense_bridge/__init__`` (which would close an import circle)."""
__version__ = "0.1.0"
