"""Cross-framework equivalence testing: compare outputs and gradients layer by layer."""
from ._tolerance import C_GRADIENT, C_OUTPUT, Tolerance, allowed_error, error_units

__all__ = ["Tolerance", "allowed_error", "error_units", "C_OUTPUT", "C_GRADIENT"]
