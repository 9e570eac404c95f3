"""Arrays across the boundary (jax.Array <-> numpy, bfloat16, float64 and x64): the JAX-family
code shared with the other JAX adapter, in ``dense_bridge.backends._jax.arrays``."""
from dense_bridge.backends._jax.arrays import *  # noqa: F401,F403
from dense_bridge.backends._jax.arrays import (DTYPES, check_dtype, dtype_name, from_numpy, to_jax, to_numpy, x64_enabled)  # noqa: F401
