"""Whether a comparison can ask each side for gradients: the ``gradients`` capability.

An adapter declares ``gradients`` in its manifest when its ``trace``/``capture`` compute them
(autograd, or a hand-written backward). A backend without it (an inference engine) is traced
forward only (``trace(..., grad_out=None)``): ``compare``/``compare_models`` then compare outputs
only and say in the report that gradients were not compared, never that they passed.
"""
from __future__ import annotations

__all__ = ["NOT_COMPARED", "computes_gradients", "effective_grads"]

#: The note every report compared with ``grads=False`` carries.
NOT_COMPARED = "gradients were NOT compared (grads=False): outputs only"


def computes_gradients(backends: dict[str, str], grads: bool = False) -> dict[str, bool]:
    """Side ("a", "b") -> whether its backend's adapter computes gradients (``grads`` is unused:
    kept so every caller reads the same)."""
    from ..registry._manifest import GRADIENTS
    from ..registry._backends import has_capability

    return {side: has_capability(name, GRADIENTS) for side, name in backends.items()}


def effective_grads(backends: dict[str, str], grads: bool) -> tuple[bool, str | None]:
    """Whether a comparison compares gradients, and the note its report must carry when it does not.

    ``grads=True`` with a side whose backend runs forward only (an inference engine such as
    onnxruntime) compares outputs only: the note names that side, so a report can never read as
    if gradients had passed."""
    from ..registry._backends import require

    for side, name in backends.items():  # a backend that cannot run models cannot be compared
        require(name, "running", f"comparing {side} (a {name!r} model)")
    if not grads:
        return False, NOT_COMPARED
    able = computes_gradients(backends)
    unable = [f"{side} ({backends[side]!r})" for side, ok in able.items() if not ok]
    if unable:
        return False, (f"gradients were NOT compared: {' and '.join(unable)} runs forward only (its backend "
                       f"declares no gradients capability): outputs only")
    return True, None
