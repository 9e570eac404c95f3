"""Packages are discovered, never listed: ``dense_bridge`` with its subpackages, and every adapter
package under ``backends/`` installed as ``dense_bridge.backends.<name>`` (the mapping is
``[tool.setuptools.package-dir]`` in pyproject.toml, where everything else is declared)."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["dense_bridge", "dense_bridge.*"]) + ["dense_bridge.backends"]
      + [f"dense_bridge.backends.{name}" for name in find_packages("backends")])
