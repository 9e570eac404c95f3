"""The importable conformance suite (dense_bridge.testing.conformance), run against every built-in
backend, as a third party runs it against its own adapter; plus what only holds across backends.

Each compiled layer is checked against the numpy reference computed in float64 from the very
same (dtype-rounded) parameters and inputs, within the FACTS.md tolerance:
C = 4 for outputs, 10 for gradients, K = the fan-in of the reduction behind each quantity.
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.testing.conformance import AdapterConformance, compile_or_skip

from conftest import ALL_BACKENDS

# one class per backend, named so that ``-k keras`` selects Keras' (tests/backends/test_keras_backends.py); onnx
# (forward only, no lazy widths, no bfloat16) runs it too, outside the global backend fixture
for _name in ALL_BACKENDS + ("onnx",):
    globals()[f"TestConformance_{_name}"] = type(f"TestConformance_{_name}", (AdapterConformance,),
                                                 {"backend": _name, "__module__": __name__})
del _name


def test_same_seed_same_bits_on_every_backend():
    specs = [db.Dense(9, in_features=7, bias_init="torch_default"),
             db.Dense(9, in_features=7, dtype="bfloat16", bias_init="normal"),
             db.Sequential([db.Dense(5, in_features=4, mask=db.wiring.random(4, 5, 0.5, 0)), db.Dense(3)]),
             db.Bilinear(2, 3, 4)]
    for spec in specs:
        reference = db.get_params(db.compile(spec, "numpy", seed=11))
        for backend in db.available_backends():
            if backend == "onnx" and getattr(spec, "dtype", None) == "bfloat16":
                with pytest.raises(db.SpecError, match="bfloat16"):  # no bfloat16 MatMul in onnxruntime's CPU provider
                    db.compile(spec, backend, seed=11)
                continue
            params = db.get_params(compile_or_skip(spec, backend, seed=11))
            assert sorted(params) == sorted(reference), backend
            for k, v in reference.items():
                got = np.asarray(params[k])
                assert got.dtype == v.dtype, (backend, k, got.dtype)
                assert got.tobytes() == np.ascontiguousarray(v).tobytes(), (backend, k)
