"""Code the JAX-family adapters (Flax NNX, Equinox) share: arrays and activations on jax.numpy.

Not an adapter itself: ``backends/flax`` and ``backends/equinox`` each keep the contract's
``_arrays.py``/``_activations.py`` files, which re-export these modules' names, so the two
adapters never import each other and the code exists once.
"""
