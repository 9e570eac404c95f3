"""torch layers built without torch's initial draw are the modules torch's own constructor makes.

The adapter builds ``nn.Linear``/``DenseLinear`` without ``__init__`` (whose draw, even on the
meta device, is replaced at once) and adopts dense_bridge's tensors. Compared here, on the
installed torch, with the same class built by its constructor and given the same tensors:
class, ``__dict__`` keys, parameter and buffer names in order, state dict, forward, and what
training and saving see.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import dense_bridge as db  # noqa: E402
from dense_bridge.backends.torch import DenseLinear  # noqa: E402

IN, OUT = 5, 3
CASES = {
    "plain": dict(),
    "no bias": dict(use_bias=False),
    "activation": dict(activation="gelu"),
    "mask": dict(mask=np.tril(np.ones((IN, OUT), np.float32))),
    "mask, no bias, activation": dict(mask=np.tril(np.ones((IN, OUT), np.float32)), use_bias=False,
                                      activation="tanh"),
}


def _by_constructor(built: nn.Module) -> nn.Module:
    """The same class built by its own constructor, holding ``built``'s tensors."""
    bias = built.bias is not None
    if type(built) is nn.Linear:
        twin = nn.Linear(IN, OUT, bias)
    else:
        mask = getattr(built, "mask", None)
        twin = DenseLinear(IN, OUT, bias, activation=built.activation, mask=mask)
    twin.load_state_dict(built.state_dict())
    return twin


def _structure(module: nn.Module) -> dict:
    # dense_bridge's own remembered spec aside (the constructor-built twin was never compiled)
    own = [k for k in vars(module) if not k.startswith("_dense_bridge")]
    return {"class": type(module), "dict": sorted(own), "parameters": list(module._parameters),
            "buffers": list(module._buffers), "state": list(module.state_dict()),
            "trainable": [n for n, _ in module.named_parameters()], "repr": repr(module)}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_layer_matches_the_constructor_built_one(case):
    spec = db.Dense(OUT, in_features=IN, **CASES[case])
    built = db.compile(spec, "torch", seed=3)
    twin = _by_constructor(built)
    assert _structure(built) == _structure(twin)
    x = torch.randn(4, IN)
    with torch.no_grad():
        assert torch.equal(built(x), twin(x))
    # training sees the same parameters and the mask stays a buffer
    opt = torch.optim.SGD(built.parameters(), lr=0.1)
    built(x).sum().backward()
    opt.step()
    assert all(p.grad is not None for p in built.parameters())
    # a state dict round trip through torch.save keeps names and values
    buf = io.BytesIO()
    torch.save(built.state_dict(), buf)
    buf.seek(0)
    restored = _by_constructor(built)
    restored.load_state_dict(torch.load(buf))
    for (n1, t1), (n2, t2) in zip(built.state_dict().items(), restored.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)


def test_converted_sequential_keeps_values_and_classes():
    spec = db.Sequential([db.Dense(4, activation="relu"), db.Dense(2, use_bias=False)], in_features=IN)
    model = db.compile(spec, "torch", seed=1)
    assert [type(m) for m in model] == [DenseLinear, nn.Linear]
    back = db.convert(db.convert(model, to="numpy"), to="torch")
    for a, b in zip(model.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    assert back[1].bias is None and "bias" not in back[1].state_dict()
