"""How the core finds backends and what they promise: the registry, manifests and the adapter contract.

- :mod:`._backends`: backend names -> adapter modules, imported on first use; which backend owns a
  native object.
- :mod:`._manifest`: what the core may know of a backend without importing its framework.
- :mod:`._contract`: the verbs an adapter package provides, required and optional by capability.
- :mod:`._trace`, :mod:`._captures`: the records the running verbs (``trace``, ``capture``) return.
- :mod:`._remembered_spec`: the one way a spec is kept on a native object.
"""
