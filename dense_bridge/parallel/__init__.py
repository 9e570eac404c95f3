"""Tensor parallelism: a spec's layers split over ranks (column/row styles), the collectives
behind compile/get_params/set_params on a parallel model, and the sharded checkpoint directories
(one safetensors file per rank plus an index; torch DCP directories read through the torch backend).
"""
