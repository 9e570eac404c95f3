"""Cross-framework equivalence testing: compare outputs and gradients layer by layer.

``compare(a, b)`` feeds two native models (any backends) identical inputs and an identical
upstream gradient, runs each framework's own forward and backward, and reports per layer the
output, dL/dx, dL/dkernel and dL/dbias errors in tolerance units; ``assert_equivalent`` is the
pytest form. The verdict is numeric by default; ``strict=True`` also fails on spec differences
that change the function or its precision (``function_differences``). Tolerances follow the
dtype and the reduction lengths (see ``_tolerance`` for the formula and ``_compare`` for how K
and S are counted along a model). ``compare_checkpoints`` gives ``compare``'s report for two
opened checkpoints (``dense_bridge.checkpoints.open_checkpoint``) holding one layer pair in memory
at a time; ``rows_structure`` the parameter structure from rows read on the way.
"""
from ._compare import assert_equivalent, compare, function_differences, spec_differences
from .compare_models import ModelReport, compare_models
from ._compare_files import compare_checkpoints
from ._structure import rows_structure
from ._report import LayerResult, QuantityResult, Report
from ._tolerance import C_GRADIENT, C_OUTPUT, Tolerance, allowed_error, error_units

__all__ = ["compare", "assert_equivalent", "compare_models", "ModelReport", "compare_checkpoints", "rows_structure", "spec_differences", "function_differences", "Report", "LayerResult",
           "QuantityResult", "Tolerance", "allowed_error", "error_units", "C_OUTPUT", "C_GRADIENT"]
