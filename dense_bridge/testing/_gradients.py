"""Whether a comparison can ask each side for gradients: the ``gradients`` capability.

An adapter declares ``gradients`` in its manifest when its ``trace``/``capture`` compute them
(autograd, or a hand-written backward). A backend without it (an inference engine) is traced
forward only (``trace(..., grad_out=None)``): ``compare``/``compare_models`` accept it with
``grads=False`` and say in the report that gradients were not compared, never that they passed.
"""
from __future__ import annotations

from .._errors import SpecError

__all__ = ["NOT_COMPARED", "computes_gradients"]

#: The note every report compared with ``grads=False`` carries.
NOT_COMPARED = "gradients were NOT compared (grads=False): outputs only"


def computes_gradients(backends: dict[str, str], grads: bool) -> dict[str, bool]:
    """Side ("a", "b") -> whether its backend's adapter computes gradients. ``grads=True`` with a
    side that cannot: SpecError naming the backend and what to pass instead."""
    from .._manifest import GRADIENTS
    from .._registry import has_capability

    able = {side: has_capability(name, GRADIENTS) for side, name in backends.items()}
    unable = [f"{side} ({backends[side]!r})" for side, ok in able.items() if not ok]
    if grads and unable:
        raise SpecError(f"{' and '.join(unable)} runs forward only: its backend declares no gradients capability; "
                        "pass grads=False to compare outputs only. Received: grads=True")
    return able
