"""Per-framework adapters, installed as ``dense_bridge.backends``.

Every adapter module offers the required verbs (``owns``, ``compile``, ``get_params``,
``set_params``, ``to_spec``, ``to_numpy``, ``from_numpy``) and the verbs of each capability it has
(running, files, lora, quant, ...: whole groups), as ``dense_bridge.registry._contract`` lists them.
Adapters import the core and their own framework, never each other.
"""
