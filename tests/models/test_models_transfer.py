"""db.transfer: whole-model weight moves between frameworks (mapping kinds, by-order safety, strict,
all-or-nothing, tied parameters, the report). Small native models; real third-party ones are in
tests/models/test_third_party.py."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from conftest import require_backend


def _torch():
    return pytest.importorskip("torch")


def _torch_encoder(seed=0):
    """embed -> norm -> up -> relu -> down, with named submodules."""
    torch = _torch()
    nn = torch.nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6)
            self.norm = nn.LayerNorm(6)
            self.up = nn.Linear(6, 8)
            self.down = nn.Linear(8, 6)

        def forward(self, ids):
            return self.down(torch.relu(self.up(self.norm(self.embed(ids)))))

    torch.manual_seed(seed)
    model = Encoder()
    with torch.no_grad():  # norms start at 1/0: make them count
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def _keras_encoder():
    require_backend("keras")
    import keras

    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(11, 6, name="tok")(ids)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln")(x)
    x = keras.layers.Dense(8, activation="relu", name="ff_in")(x)
    x = keras.layers.Dense(6, name="ff_out")(x)
    return keras.Model(ids, x, name="enc")


MAP = {"embed": "tok", "norm": "ln", "up": "ff_in", "down": "ff_out"}


def _outputs(src, dst, ids):
    torch = _torch()
    with torch.no_grad():
        a = src(torch.tensor(ids)).numpy()
    import keras

    return a, keras.ops.convert_to_numpy(dst(ids))  # on KERAS_BACKEND=torch a grad-tracking tensor


def test_dict_mapping_moves_linear_norm_and_embedding_layers_torch_to_keras():
    src, dst = _torch_encoder(), _keras_encoder()
    report = db.transfer(src, dst, mapping=MAP)
    ids = np.random.default_rng(0).integers(0, 11, (2, 5))
    a, b = _outputs(src, dst, ids)
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    moved = {s: d for s, d, _ in report.moved}
    assert moved["norm.weight"] == "ln/gamma" and moved["norm.bias"] == "ln/beta"  # the name table
    assert moved["embed.weight"] == "tok/embeddings"
    assert moved["up"] == "ff_in"  # linear layers move whole, in the canonical layout
    assert report.not_moved_src == [] and report.not_moved_dst == []
    np.testing.assert_array_equal(dst.get_layer("ff_in").kernel.numpy(), src.up.weight.detach().numpy().T)
    assert "ln/gamma" in str(report) and report.to_dict()["src_backend"] == "torch"


def test_regex_rules_and_callable_mapping_and_parameter_paths():
    src = _torch_encoder()
    dst = _keras_encoder()
    rules = [(r"embed", "tok"), (r"norm", "ln"), (r"(up|down)", r"ff_\1")]
    with pytest.raises(db.ConversionError, match="'ff_up'"):  # the rule's targets must exist
        db.transfer(src, dst, mapping=rules)
    rules = [(r"embed", "tok"), (r"norm", "ln"), (r"up", "ff_in"), (r"down", "ff_out")]
    assert db.transfer(src, dst, mapping=rules).num_moved == 5  # embedding, gamma, beta, 2 linear layers
    fresh = _keras_encoder()
    db.transfer(src, fresh, mapping=lambda p: MAP.get(p))
    np.testing.assert_array_equal(fresh.get_layer("ln").gamma.numpy(), src.norm.weight.detach().numpy())
    # a parameter path named directly moves as stored (shapes must agree)
    other = _keras_encoder()
    partial = {"up": "ff_in", "down": "ff_out", "embed.weight": "tok/embeddings", "norm.weight": "ln/gamma"}
    gamma = other.get_layer("ln").gamma.numpy().copy()
    with pytest.raises(db.ConversionError, match=r"left unwritten: \['ln/beta'\]"):  # strict: complete
        db.transfer(src, other, mapping=partial, strict=True)
    np.testing.assert_array_equal(other.get_layer("ln").gamma.numpy(), gamma)  # nothing written
    report = db.transfer(src, other, mapping=partial, strict=False)
    assert ("norm.weight", "ln/gamma", "parameter") in report.moved
    assert report.not_moved_src == ["norm.bias"] and report.not_moved_dst == ["ln/beta"]


def test_by_order_matches_chains_and_refuses_a_silent_swap():
    torch = _torch()
    require_backend("mlx")
    import mlx.core as mx
    import mlx.nn as mnn

    src = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    dst = db.compile(db.Sequential([db.Dense(5, in_features=4, activation="relu"), db.Dense(3)]), "mlx", seed=1)
    report = db.transfer(src, dst)  # different names ("0", "2" vs "layers.0", "layers.1"): fine by order
    assert [(s, d) for s, d, _ in report.moved] == [("0", "layers.0"), ("2", "layers.1")]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(dst(mx.array(x))), src(torch.tensor(x)).detach().numpy(), atol=1e-6)

    class TorchMLP(torch.nn.Module):  # transformers' order: gate, up, down
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = (torch.nn.Linear(4, 4) for _ in range(3))

    class MlxMLP(mnn.Module):  # mlx-lm's order: gate, down, up
        def __init__(self):
            super().__init__()
            self.gate, self.down, self.up = mnn.Linear(4, 4), mnn.Linear(4, 4), mnn.Linear(4, 4)

    a, b = TorchMLP(), MlxMLP()
    before = np.array(b.up.weight)
    with pytest.raises(db.ConversionError, match="'up'.*'down'|'down'.*'up'"):
        db.transfer(a, b)
    np.testing.assert_array_equal(np.array(b.up.weight), before)  # nothing written
    db.transfer(a, b, mapping=[(r"(.*)", r"\1")])  # same paths: an identity rule
    np.testing.assert_array_equal(np.array(b.up.weight), a.up.weight.detach().numpy())
    with pytest.raises(db.ConversionError, match="src has 2 and dst has 3"):
        db.transfer(src, b)


def test_strict_lists_everything_unmatched_and_idle_rules():
    src, dst = _torch_encoder(), _keras_encoder()
    with pytest.raises(db.ConversionError) as info:
        db.transfer(src, dst, mapping=[(r"up", "ff_in"), (r"nothing", "x")])
    text = str(info.value)
    assert "['down']" in text and "['ff_out']" in text and "'nothing'" in text and "nothing was written" in text
    report = db.transfer(src, dst, mapping={"up": "ff_in"}, strict=False)
    assert [s for s, _, _ in report.moved] == ["up"]
    assert set(report.not_moved_src) == {"embed.weight", "norm.weight", "norm.bias", "down.weight", "down.bias"}
    assert set(report.not_moved_dst) == {"tok/embeddings", "ln/gamma", "ln/beta", "ff_out/kernel", "ff_out/bias"}


def test_all_or_nothing_on_a_misfit():
    torch = _torch()
    src, dst = _torch_encoder(), _keras_encoder()
    src.down = torch.nn.Linear(8, 7)  # 7 units, dst has 6
    before = {w.path: w.numpy().copy() for w in dst.weights}
    with pytest.raises(db.ConversionError, match="does not fit"):
        db.transfer(src, dst, mapping=MAP)
    for w in dst.weights:
        np.testing.assert_array_equal(w.numpy(), before[w.path])
    src = _torch_encoder()
    with torch.no_grad():
        src.norm.weight[0] = float("nan")
    with pytest.raises(db.ConversionError, match="NaN"):
        db.transfer(src, dst, mapping=MAP)
    np.testing.assert_array_equal(dst.get_layer("ln").gamma.numpy(), before["ln/gamma"])


def test_a_transform_returning_complex_values_is_refused_and_nothing_is_written():
    """A parameter holds real values: a complex result would lose its imaginary part in the cast."""
    src, dst = _torch_encoder(), _keras_encoder()
    before = {w.path: w.numpy().copy() for w in dst.weights}
    mapping = {**MAP, "norm.weight": ("ln/gamma", lambda a: a * (1 + 1j))}
    with pytest.raises(db.ConversionError, match=r"norm\.weight.*real numbers.*complex"):
        db.transfer(src, dst, mapping=mapping)
    for w in dst.weights:
        np.testing.assert_array_equal(w.numpy(), before[w.path])


@pytest.mark.parametrize("rule", [r"(a+)+$", r"((\w+)\.)*up", r"(?:x|(?:y+))*z", "a" * 600])
def test_mapping_rules_that_could_backtrack_for_ages_are_refused_before_any_match(rule):
    """A nested quantifier backtracks exponentially on a path that almost matches (``(a+)+$`` on
    30 a's and a '!' runs for minutes): such a rule, or one longer than the bound, is refused
    naming it before it meets any path."""
    src, dst = _torch_encoder(), _keras_encoder()
    with pytest.raises(db.SpecError, match=r"mapping rule .*(nests one quantifier|characters)"):
        db.transfer(src, dst, mapping=[(rule, r"x")])
    with pytest.raises(db.SpecError, match=r"mapping rule"):
        db.testing.compare_models(src, dst, [np.zeros((1, 3), np.int64)], mapping=[(rule, r"x")])


def test_tied_parameters_move_once():
    torch = _torch()
    require_backend("mlx")
    import mlx.nn as mnn

    class TiedLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.wte.weight  # GPT-2's tie

    class MlxLM(mnn.Module):  # ties by calling wte.as_linear: no head of its own
        def __init__(self):
            super().__init__()
            self.wte = mnn.Embedding(10, 4)
            self.proj = mnn.Linear(4, 4)

    src, dst = TiedLM(), MlxLM()
    report = db.transfer(src, dst, mapping=[(r"(wte|proj)", r"\1")])
    assert report.tied == {"lm_head.weight": "wte.weight"}
    assert report.not_moved_src == [] and report.not_moved_dst == []
    np.testing.assert_array_equal(np.array(dst.wte.weight), src.wte.weight.detach().numpy())
    # the other way: dst's head is tied, so writing wte writes it; nothing is required of it
    back = TiedLM()
    report = db.transfer(dst, back, mapping=[(r"(wte|proj)", r"\1")])
    np.testing.assert_array_equal(back.lm_head.weight.detach().numpy(), np.array(dst.wte.weight))
    assert report.tied == {"lm_head.weight": "wte.weight"}


def test_bad_arguments():
    src, dst = _torch_encoder(), _keras_encoder()
    with pytest.raises(TypeError, match="mapping"):
        db.transfer(src, dst, mapping=3)
    with pytest.raises(TypeError, match="mapping"):
        db.transfer(src, dst, mapping=[("a",)])
    with pytest.raises(db.SpecError, match="regular expression"):
        db.transfer(src, dst, mapping=[("(", "x")])
    with pytest.raises(TypeError, match="strict"):
        db.transfer(src, dst, mapping=MAP, strict="yes")
    with pytest.raises(db.ConversionError, match="'nrom'.*Did you mean 'norm"):
        db.transfer(src, dst, mapping={**MAP, "nrom": "ln"})
    with pytest.raises(TypeError, match="returned 3"):
        db.transfer(src, dst, mapping=lambda p: 3)
    with pytest.raises(TypeError, match="model"):
        db.transfer(object(), dst)
    with pytest.raises(db.ConversionError, match="linear layer but"):
        db.transfer(src, dst, mapping={**MAP, "up": "ln"})
