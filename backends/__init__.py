"""Per-framework adapters, installed as ``dense_bridge.backends``.

Every adapter module offers the same verbs (see ``dense_bridge.registry._contract`` for the contract):
``owns``, ``compile``, ``get_params``, ``set_params``, ``to_spec``, ``trace``.
Adapters import the core and their own framework, never each other.
"""
