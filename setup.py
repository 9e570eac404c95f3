"""Packages are discovered, never listed: ``dense_bridge`` with its subpackages, and every adapter
package under ``backends/`` installed as ``dense_bridge.backends.<name>`` (the mapping is
``[tool.setuptools.package-dir]`` in pyproject.toml, where everything else is declared).

One optional C extension, ``dense_bridge.params._copy_kernels`` (a copy that counts NaN/Inf in the same pass):
built where a C compiler is found; without it the install still succeeds and dense_bridge
uses numpy for the same results (``dense_bridge.params._copy.COPY_KERNELS``)."""
import sys

from setuptools import Extension, find_packages, setup

_FLAGS = [] if sys.platform == "win32" else ["-O3"]

setup(packages=find_packages(include=["dense_bridge", "dense_bridge.*"]) + ["dense_bridge.backends"]
      + [f"dense_bridge.backends.{name}" for name in find_packages("backends")],
      ext_modules=[Extension("dense_bridge.params._copy_kernels", ["dense_bridge/params/_copy_kernels.c"], optional=True,
                             extra_compile_args=_FLAGS)])
