"""Canonical parameters: drawn from a seed, given, checked, fitted in memory, copied into a layout.

- :mod:`._source`: :class:`ParamSource`, initial values, validation of user-given arrays.
- :mod:`._memory_budget`: refusing work whose parameter bytes cannot fit in the memory available.
- :mod:`._copy`: aligned fresh buffers, the blocked transpose and the NaN/Inf count, using the
  optional C kernels of ``_copy_kernels.c`` where they were built.
"""
