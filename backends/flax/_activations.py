"""dense_bridge activations <-> jax.nn functions: the JAX-family code shared with the other JAX
adapter, in ``dense_bridge.backends._jax.activations``."""
from dense_bridge.backends._jax.activations import *  # noqa: F401,F403
from dense_bridge.backends._jax.activations import (activation_fn, activation_of_function, conversion_error, identity)  # noqa: F401
