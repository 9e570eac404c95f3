"""Every form a user writes inputs in works the same in ``testing.compare`` and ``compare_models``
(and so in ``dense-bridge check``, which hands compare_models its .npz arrays): an array of any
framework, a positional list, a keyword dict, a list holding one dict, token ids as Python lists.
Anything else is one TypeError naming the form received; an input with no rows is refused."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from _port_helpers import randomize, transformers_or_skip

V = 48
IDS = np.random.default_rng(0).integers(0, V, (2, 7))
X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


def _framework_forms(value: np.ndarray) -> dict:
    """``value`` as each installed framework's own array."""
    forms = {}
    try:
        import torch

        forms["torch"] = torch.tensor(value)
        if value.dtype.kind == "f":
            forms["torch (requires grad)"] = torch.tensor(value, requires_grad=True)
    except ImportError:
        pass
    try:
        import mlx.core as mx

        forms["mlx"] = mx.array(value)
    except ImportError:
        pass
    try:
        import jax.numpy as jnp

        forms["jax"] = jnp.asarray(value)
    except ImportError:
        pass
    return forms


@pytest.fixture(scope="module")
def llamas():
    transformers = transformers_or_skip()
    import torch

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(config).eval()
    randomize(src)
    port = transformers.LlamaForCausalLM(config).eval()
    db.transfer(src, port, mapping=[(r"(.*)", r"\1")])
    return src, port


def _units(report) -> list[float]:
    return [q.units for q in report.rows]


def test_compare_models_reads_every_form_of_the_same_inputs_alike(llamas):
    src, port = llamas
    reference = db.testing.compare_models(src, port, IDS)
    assert reference.passed and reference.compared, str(reference)
    forms = {"list": [IDS], "dict": {"input_ids": IDS}, "list of one dict": [{"input_ids": IDS}],
             "tuple": (IDS,), "Python lists": IDS.tolist(), "list of Python lists": [IDS.tolist()],
             **_framework_forms(IDS)}
    forms.update({f"[{k}]": [v] for k, v in _framework_forms(IDS).items()})
    forms.update({f"{{{k}}}": {"input_ids": v} for k, v in _framework_forms(IDS).items()})
    for name, form in forms.items():
        report = db.testing.compare_models(src, port, form)
        assert report.passed, f"{name}: {report}"
        assert report.input_shapes == [IDS.shape], name
        assert _units(report) == _units(reference), name


@pytest.mark.parametrize("form", [np.zeros((0, 7), np.int64), [np.zeros((0, 7), np.int64)],
                                  {"input_ids": np.zeros((0, 7), np.int64)}, [[]]])
def test_compare_models_refuses_an_input_without_rows(llamas, form):
    src, port = llamas
    with pytest.raises(db.SpecError, match="at least one") as info:
        db.testing.compare_models(src, port, form)
    assert "inputs" in str(info.value)


@pytest.mark.parametrize("form,words", [
    ("abc", ["inputs", "'abc'"]),
    ({1: IDS}, ["inputs", "keys"]),
    ([IDS, {"attention_mask": IDS}], ["inputs", "dict"]),
    ({"input_ids": 3}, ["inputs['input_ids']", "plain number", "{'input_ids': 3}"]),
    ({"input_ids": "abc"}, ["inputs['input_ids']", "'abc'"]),
    ({"a", "b"}, ["inputs", "set"]),
    (None, ["inputs", "None"]),
])
def test_compare_models_names_a_form_it_cannot_read(llamas, form, words):
    src, port = llamas
    with pytest.raises(TypeError) as info:
        db.testing.compare_models(src, port, form)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_compare_reads_every_form_of_the_same_inputs_alike():
    a = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    b = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    reference = db.testing.compare(a, b, inputs=X)
    assert reference.passed
    forms = {"list": [X], "tuple": (X,), "dict": {"x": X}, "list of one dict": [{"x": X}],
             "Python lists": X.tolist(), **_framework_forms(X)}
    forms.update({f"[{k}]": [v] for k, v in _framework_forms(X).items()})
    for name, form in forms.items():
        report = db.testing.compare(a, b, inputs=form)
        assert report.passed and report.input_shapes == [X.shape], f"{name}: {report}"
        assert _units(report) == _units(reference), name


@pytest.mark.parametrize("form", [np.zeros((0, 4)), [np.zeros((0, 4))], {"x": np.zeros((0, 4))}])
def test_compare_refuses_an_input_without_rows(form):
    a = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    with pytest.raises(db.SpecError, match=r"\(0, 4\)"):
        db.testing.compare(a, a, inputs=form)


def test_compare_wants_one_array_for_a_dense_and_names_what_came():
    a = db.compile(db.Dense(3, in_features=4), "numpy", seed=0)
    with pytest.raises(db.SpecError, match="received 2 input"):
        db.testing.compare(a, a, inputs=[X, X])
    with pytest.raises(TypeError, match="x.*plain number"):
        db.testing.compare(a, a, inputs={"x": 1.5})
