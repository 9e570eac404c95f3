"""Equivalence reports that settle arguments: teacher-forced layers, ULPs, worst elements, structure.

- ``isolated=True`` (``compare``, ``compare_models``, ``dense-bridge check --isolated``): a fault
  planted in layer 3 of a 6-layer port is blamed on layer 3 alone, while the cascaded mode shows
  it downstream;
- per quantity: ULPs in the coarser dtype, the fraction of elements out of tolerance, the worst
  element with both values, NaN/Inf positions; "bit-identical" only when every value matches;
- structure first: unmatched, tied and dtype-differing parameters and both parameter counts;
- the HTML page: first divergence at the top, per-layer histograms, collapsible layers;
- each adapter's ``run_layer`` verb against numpy.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db
from conftest import ALL_BACKENDS, require_backend
from dense_bridge.cli import _main as cli
from dense_bridge.testing import compare, compare_models
from dense_bridge.testing._elements import element_stats, elementwise_units, ulp_distance

SIX = db.Sequential([db.Dense(8, activation="tanh") for _ in range(5)] + [db.Dense(4)], in_features=8)


def _planted(backend: str, layer: int = 3, factor: float = 1.01):
    """SIX on ``backend`` with one weight of ``layer`` scaled by ``factor``."""
    model = db.compile(SIX, backend, seed=0)
    p = db.get_params(model)
    k = p[f"{layer}.kernel"].copy()
    k[2, 3] *= factor
    db.set_params(model, {**p, f"{layer}.kernel": k})
    return model


# ---------------------------------------------------------------------------- teacher forcing
@pytest.mark.parametrize("pair", [("numpy", "torch"), ("torch", "keras")])
def test_fault_in_layer_3_is_blamed_on_layer_3_alone_in_isolated_mode(pair):
    for name in pair:
        require_backend(name)
    a = db.compile(SIX, pair[0], seed=0)
    b = _planted(pair[1])
    cascaded = compare(a, b)
    isolated = compare(a, b, isolated=True)
    assert cascaded.first_divergence == isolated.first_divergence == 3
    assert not cascaded.isolated and isolated.isolated
    # isolated: layer 3 fails, every other layer (4 and 5 after it, 0..2 before it) passes
    assert [layer.passed for layer in isolated.layers] == [True, True, True, False, True, True], str(isolated)
    assert not isolated.layers[3]["output"].passed
    # cascaded: the difference reaches downstream (layers 4 and 5 fail) and, backward, upstream
    assert not cascaded.layers[4].passed and not cascaded.layers[5].passed, str(cascaded)
    assert cascaded.layers[5]["output"].max_abs_error > 100 * isolated.layers[5]["output"].max_abs_error
    assert "mode: isolated" in str(isolated) and "isolated" in isolated.notes[-1]
    assert isolated.to_dict()["isolated"] is True


def _torch_mlp(fault: bool):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
    if fault:
        with torch.no_grad():
            net[6].weight[2, 3] *= 1.01  # the 4th linear layer: layer 3
    return net


def test_compare_models_isolated_judges_each_layer_on_what_a_gave_it():
    pytest.importorskip("torch")
    x = [np.random.default_rng(0).standard_normal((4, 8))]
    a, b = _torch_mlp(False), _torch_mlp(True)
    cascaded = compare_models(a, b, x)
    isolated = compare_models(a, b, x, isolated=True)
    assert cascaded.first_divergence == isolated.first_divergence == "6"
    out_iso = {pb: layer["output"] for (_, pb, _), layer in zip(isolated.calls, isolated.layers)}
    out_cas = {pb: layer["output"] for (_, pb, _), layer in zip(cascaded.calls, cascaded.layers)}
    assert not out_iso["6"].passed
    # layers 4 and 5 (paths "8" and "10"): run on a's own input, the same engine gives the same bits
    for path in ("8", "10"):
        assert out_iso[path].bit_identical and out_iso[path].stats.ulp_max == 0
        assert out_cas[path].max_abs_error > 0 and out_cas[path].stats.ulp_max > 100  # cascaded: carried drift
    # the forced backward gives dL/dx rows: only layer 3's fails
    dx = {pb: layer["dL/dx"] for (_, pb, _), layer in zip(isolated.calls, isolated.layers)}
    assert [p for p, q in dx.items() if not q.passed] == ["6"]
    assert all(q.bit_identical for p, q in dx.items() if p != "6")
    assert any("teacher forcing" in n for n in isolated.notes)


def test_a_layer_that_cannot_run_alone_is_named(monkeypatch):
    pytest.importorskip("torch")
    from dense_bridge.registry._backends import get_adapter

    x = [np.random.default_rng(0).standard_normal((4, 8))]
    a, b = _torch_mlp(False), _torch_mlp(False)
    adapter = get_adapter("torch")
    monkeypatch.delattr(adapter, "run_layer")
    report = compare_models(a, b, x, isolated=True)
    assert report.passed and any("cannot run one layer alone" in n and "'torch'" in n for n in report.notes)


def test_isolated_is_a_flag():
    pytest.importorskip("torch")
    with pytest.raises(TypeError, match="isolated"):
        compare(db.compile(SIX, "numpy", seed=0), db.compile(SIX, "numpy", seed=0), isolated="yes")


# ---------------------------------------------------------------------------- element statistics
def test_same_engine_pair_is_bit_identical_with_0_ulp():
    a, b = db.compile(SIX, "numpy", seed=0), db.compile(SIX, "numpy", seed=0)
    report = compare(a, b)
    assert report.passed and report.bit_identical
    assert all(q.stats.ulp_max == 0 and q.stats.ulp_median == 0 and q.stats.n_out == 0 for q in report.rows)
    assert report.verdict().startswith("PASS: bit-identical") and "0 ULP" in report.verdict()
    assert json.loads(report.to_json())["bit_identical"] is True
    # across engines the sums run in another order: within tolerance, never called bit-identical
    require_backend("torch")
    other = compare(a, db.compile(SIX, "torch", seed=0))
    assert other.passed and not other.bit_identical and "bit-identical" not in other.verdict()
    assert any(q.stats.ulp_max > 0 for q in other.rows)


def test_bfloat16_rounded_layer_shows_its_ulps():
    from dense_bridge._dtypes import numpy_dtype

    a = db.compile(SIX, "numpy", seed=0)
    p = db.get_params(a)
    rounded = {**p, "1.kernel": p["1.kernel"].astype(numpy_dtype("bfloat16")).astype(np.float32)}
    b = db.compile(SIX, "numpy", params=rounded)
    report = compare(a, b, isolated=True)
    out = report.layers[1]["output"]
    assert not out.passed and out.stats.ulp_dtype == "float32"
    # a bfloat16 kernel is ~2^-9 relative off: thousands of float32 ULPs, in most elements
    assert out.stats.ulp_max > 1000 and out.stats.ulp_median > 100
    assert out.stats.n_out > out.stats.n_total // 2
    assert report.layers[0]["output"].bit_identical  # before it: nothing differs
    text = str(report)
    assert "ULP max/med" in text and out.stats.fraction in text
    # against a real bfloat16 model the ULPs are counted in bfloat16, the coarser dtype
    r16 = compare(a, db.compile(_bf16_six(), "numpy", seed=0))
    assert r16.passed, str(r16)
    q = r16.layers[0]["output"]
    # a few bfloat16 ULPs at most (more only near 0, where ULPs are tiny), most elements exact
    assert q.stats.ulp_dtype == "bfloat16" and 0 < q.stats.ulp_max <= 32 and q.stats.ulp_median <= 1


def _bf16_six():
    return db.Sequential([db.Dense(8, activation="tanh", dtype="bfloat16") for _ in range(5)]
                         + [db.Dense(4, dtype="bfloat16")], in_features=8)


def test_ulp_distance_zero_signs_and_nan_positions():
    a = np.array([1.0, 0.0, -0.0, np.nan, 2.0, -1e-45], np.float32)
    b = np.array([np.nextafter(np.float32(1), np.float32(2)), -0.0, 0.0, np.nan, np.nan, 1e-45], np.float32)
    d = ulp_distance(a, b, "float32")
    assert list(d[:4]) == [1.0, 0.0, 0.0, 0.0] and np.isnan(d[4]) and d[5] == 2.0
    _, units = elementwise_units(a, b, 1e-3)
    s = element_stats(a, b, units, "float32")
    assert s.nan_a == 1 and s.nan_b == 2 and s.nonfinite_mismatch == 1
    assert s.n_out == 1 and s.worst_index == (4,) and s.worst_b != s.worst_b  # the NaN faces 2.0
    assert s.ulp_max == np.inf and not s.bit_identical
    assert "1 position(s) disagree" in s.nonfinite and s.fraction == "1/6 (16.7%)"


def test_nan_at_different_positions_fails_and_is_counted():
    spec = db.Dense(4, in_features=5)
    p = db.get_params(db.compile(spec, "numpy", seed=0))
    ka, kb = p["kernel"].copy(), p["kernel"].copy()
    ka[0, 1] = np.nan  # a's NaN feeds output column 1, b's column 2
    kb[0, 2] = np.nan
    a = db.compile(spec, "numpy", params={**p, "kernel": ka}, allow_nonfinite=True)
    b = db.compile(spec, "numpy", params={**p, "kernel": kb}, allow_nonfinite=True)
    report = compare(a, b, grads=False)
    out = report.layers[0]["output"]
    assert not out.passed and not report.passed
    assert out.stats.nan_a == out.stats.nan_b == 8 and out.stats.nonfinite_mismatch == 16
    assert out.stats.n_out == 16 and out.stats.fraction == "16/32 (50.0%)"
    assert "16 position(s) disagree" in str(report)
    # the same NaN positions on both sides are equal, not a failure
    same = compare(a, db.compile(spec, "numpy", params={**p, "kernel": ka}, allow_nonfinite=True), grads=False)
    assert same.passed and same.layers[0]["output"].stats.nonfinite_mismatch == 0


def test_json_holds_fraction_and_worst_index_of_a_planted_difference():
    spec = db.Dense(4, in_features=5)
    a = db.compile(spec, "numpy", seed=0)
    p = db.get_params(a)
    k = p["kernel"].copy()
    k[3, 2] += 0.5  # input feature 3 -> unit 2
    b = db.compile(spec, "numpy", params={**p, "kernel": k})
    x = np.random.default_rng(1).standard_normal((8, 5))
    doc = json.loads(compare(a, b, inputs=x, grads=False).to_json())
    row = doc["layers"][0]["quantities"][0]
    assert row["quantity"] == "output" and row["passed"] is False
    el = row["elements"]
    assert el["fraction_out_of_tolerance"] == "8/32 (25.0%)" and el["n_out_of_tolerance"] == 8
    assert el["worst_index"] == [int(np.argmax(np.abs(x[:, 3]))), 2]
    y = x.astype(np.float32) @ p["kernel"] + p["bias"]
    assert el["worst_a"] == pytest.approx(float(y[el["worst_index"][0], 2]), rel=1e-6)


# ---------------------------------------------------------------------------- structure
def test_structure_lists_an_unmatched_norm_ties_and_counts():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self, extra: bool):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"lin": torch.nn.Linear(6, 6),
                                                                    "norm": torch.nn.LayerNorm(6)})
                                               for _ in range(3)])
            self.extra = torch.nn.LayerNorm(6) if extra else None
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight  # tied to the embedding

        def forward(self, ids):
            h = self.embed(ids)
            for i, block in enumerate(self.blocks):
                h = block["norm"](torch.tanh(block["lin"](h)))
                if i == 0 and self.extra is not None:
                    h = self.extra(h)
            return self.head(h)

    torch.manual_seed(0)
    a, b = Net(False), Net(True)
    ids = [np.random.default_rng(0).integers(0, 10, (2, 3))]
    report = compare_models(a, b, ids, mapping=[(r"(.*)", r"\1")])
    s = report.structure
    assert s.unmatched_b == ["extra.weight", "extra.bias"] and s.unmatched_a == []
    assert s.params_a == 10 * 6 + 3 * (36 + 6 + 12) and s.params_b == s.params_a + 12
    assert s.tied_a == {"head.weight": "embed.weight"} and s.tied_b == {"head.weight": "embed.weight"}
    text = str(report)
    assert text.index("structure:") < text.index("layer  type")  # before the numbers
    assert "unmatched in b (2): extra.weight, extra.bias" in text
    d = report.to_dict()["structure"]
    assert d["unmatched_b"] == ["extra.weight", "extra.bias"] and d["params_b"] == s.params_b


def test_structure_of_spec_models_names_dtype_differences():
    a = db.compile(SIX, "numpy", seed=0)
    b = db.compile(_bf16_six(), "numpy", seed=0)
    s = compare(a, b).structure
    assert s.params_a == s.params_b == SIX.num_params
    assert ("0.kernel", "0.kernel", "float32", "bfloat16") in s.dtype_differences
    assert len(s.dtype_differences) == 12 and not s.unmatched_a and not s.unmatched_b


# ---------------------------------------------------------------------------- HTML
def test_html_first_divergence_on_top_histograms_and_collapsible_layers(tmp_path):
    deep = db.Sequential([db.Dense(6, activation="tanh") for _ in range(23)] + [db.Dense(3)], in_features=6)
    a = db.compile(deep, "numpy", seed=0)
    p = db.get_params(a)
    k = p["17.kernel"].copy()
    k[1, 1] += 0.05
    b = db.compile(deep, "numpy", params={**p, "17.kernel": k})
    report = compare(a, b, isolated=True)
    assert report.first_divergence == 17
    page = report.to_html(tmp_path / "r.html")
    assert page == (tmp_path / "r.html").read_text()
    first = page.index("First divergence: layer 17")
    assert first < page.index("Error per layer") < page.index("<details")
    assert page.count("<details") == 24 and page.count("<details open>") == 1  # only layer 17 unfolded
    # one histogram per layer, bins titled; the failing layer's first
    assert page.count('class="hist"') + page.count('class="hist bad"') == 24 and "units:" in page
    assert page.count('class="hist bad"') == 1 and page.index('class="hist bad"') < page.index('class="hist"')
    assert "Structure (before running)" in page and "ULP max/med" in page and "<script" not in page


# ---------------------------------------------------------------------------- the CLI
def test_cli_check_isolated_table_and_json(tmp_path, capsys):
    require_backend("torch")
    db.save(db.compile(SIX, "torch", seed=0), tmp_path / "a.safetensors")
    db.save(_planted("torch"), tmp_path / "b.safetensors")
    args = ["check", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert cli.main(args + ["--isolated", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)["report"]
    assert doc["isolated"] is True and doc["first_divergence"] == 3
    assert [layer["passed"] for layer in doc["layers"]] == [True, True, True, False, True, True]
    out3 = doc["layers"][3]["quantities"][0]
    assert out3["elements"]["n_out_of_tolerance"] > 0 and out3["elements"]["worst_index"] is not None
    assert cli.main(args) == 1  # cascaded, streamed layer by layer: downstream layers fail too
    text = capsys.readouterr().out
    assert "ULP max/med" in text and "out of tol" in text and "mode: isolated" not in text
    assert f"structure: a has {SIX.num_params:,} parameters, b has {SIX.num_params:,}" in text


# ---------------------------------------------------------------------------- run_layer
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("activation", [None, "tanh"])
def test_run_layer_matches_numpy(backend, activation):
    adapter = require_backend(backend)
    layer = db.compile(db.Dense(3, in_features=4, activation=activation), backend, seed=0)
    p = {k: v.astype(np.float64) for k, v in db.get_params(layer).items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    g = rng.standard_normal((2, 5, 3)).astype(np.float32)
    y, dx, grads = adapter.run_layer(layer, x, g)
    z = x.astype(np.float64) @ p["kernel"] + p["bias"]
    # the output is what capture records: Keras, Flax and Equinox before the layer's own activation
    pre = activation is not None and backend in ("keras", "flax", "equinox")
    want = z if activation is None or pre else np.tanh(z)
    dz = g if activation is None or pre else g * (1 - np.tanh(z) ** 2)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dz @ p["kernel"].T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["kernel"], x.reshape(-1, 4).T @ dz.reshape(-1, 3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["bias"], dz.reshape(-1, 3).sum(0), rtol=1e-4, atol=1e-5)
    y2, none, empty = adapter.run_layer(layer, x, None)  # forward only
    np.testing.assert_array_equal(y2, y)
    assert none is None and empty == {}
    for k, v in db.get_params(layer).items():  # the parameters are untouched
        np.testing.assert_array_equal(v.astype(np.float64), p[k])


# ---------------------------------------------------------------------------- real ports, forced
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_bert_port_isolated_through_einsum_dense_reshapes():
    """keras-hub's EinsumDense takes (batch, seq, heads, head_dim) where torch's Linear takes
    (batch, seq, hidden): the forced inputs and cotangents are reshaped to b's native shapes."""
    import _compare_ports as P

    pytest.importorskip("transformers")
    pytest.importorskip("keras_hub")
    src, port = P.torch_bert(0), P.keras_bert()
    P.port_bert(src, port)
    inputs = P.bert_inputs(0)
    report = compare_models(src, port, inputs, mapping=P.BERT_RULES, isolated=True)
    assert report.passed and report.isolated, str(report)
    rows = {pb: layer for (_, pb, _), layer in zip(report.calls, report.layers)}
    attention_output = rows["transformer_layer_0/self_attention_layer/attention_output"]
    assert attention_output["dL/dx"].shape == (2 * 7, P.H) and attention_output["output"].passed
    assert not [n for n in report.notes if "judged as in cascaded mode" in n], report.notes
    # a dropped bias is named at its layer, and the layers after it keep passing their own rows
    layer = db.linear_layers(port)["transformer_layer_0/feedforward_output_dense"]
    p = db.get_params(layer)
    db.set_params(layer, {**p, "bias": np.zeros_like(p["bias"])})
    bad = compare_models(src, port, inputs, mapping=P.BERT_RULES, isolated=True)
    assert bad.first_divergence_a == "encoder.layer.0.output.dense" and bad.first_failure.quantity == "output"
    own = [pb for (_, pb, _), layer in zip(bad.calls, bad.layers)
           if any(not q.passed for q in layer.quantities if q.quantity in ("output", "dL/dx", "dL/dkernel"))]
    assert own == ["transformer_layer_0/feedforward_output_dense"], str(bad)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_float32_original_against_bfloat16_port_isolated_casts_the_forced_inputs():
    import _compare_ports as P

    pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm")
    src, port = P.torch_llama(0), P.mlx_llama("bfloat16")
    P.port_llama(src, port)
    report = compare_models(src, port, P.lm_inputs(0), mapping=[(r"(.*)", r"\1")], isolated=True)
    assert report.passed, str(report)
    q = report.layers[0]["output"]
    assert q.stats.ulp_dtype == "bfloat16" and report.dtype == "bfloat16"
    assert report.structure.dtype_differences  # every matched parameter: float32 vs bfloat16
    assert all(da == "float32" and db_ == "bfloat16" for _, _, da, db_ in report.structure.dtype_differences)


def test_compare_models_same_engine_pair_is_bit_identical():
    torch = pytest.importorskip("torch")
    a = _torch_mlp(False)
    b = _torch_mlp(False)
    x = [np.random.default_rng(0).standard_normal((4, 8))]
    for isolated in (False, True):
        report = compare_models(a, b, x, isolated=isolated)
        assert report.bit_identical and report.verdict().startswith("PASS: bit-identical"), str(report)
    with torch.no_grad():
        b[0].bias[0] += 1e-7  # one ULP-scale change: within tolerance, no longer bit-identical
    report = compare_models(a, b, x)
    assert report.passed and not report.bit_identical and "bit-identical" not in report.verdict()


def test_cli_check_model_files_isolated(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save(_torch_mlp(False), tmp_path / "a.pt")
    torch.save(_torch_mlp(True), tmp_path / "b.pt")
    np.savez(tmp_path / "x.npz", np.random.default_rng(0).standard_normal((4, 8)))
    code = cli.main(["check", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--inputs", str(tmp_path / "x.npz"),
                     "--trust-pickle", "--isolated", "--json"])
    assert code == 1
    doc = json.loads(capsys.readouterr().out)["report"]
    assert doc["isolated"] is True and doc["first_divergence"] == "6"
    assert doc["structure"]["params_a"] == doc["structure"]["params_b"] == 6 * (64 + 8)
    failing = {layer["layer_type"] for layer in doc["layers"] if not layer["passed"]}
    assert failing == {"6"}


def test_isolated_forward_only():
    a, b = db.compile(SIX, "numpy", seed=0), _planted("numpy")
    report = compare(a, b, grads=False, isolated=True)
    assert report.isolated and {q.quantity for q in report.rows} == {"output"}
    assert [layer.passed for layer in report.layers] == [True, True, True, False, True, True]
    pytest.importorskip("torch")
    x = [np.random.default_rng(0).standard_normal((4, 8))]
    forced = compare_models(_torch_mlp(False), _torch_mlp(True), x, grads=False, isolated=True)
    assert {q.quantity for q in forced.rows} == {"input", "output", "model output"}
    assert [pb for (_, pb, _), layer in zip(forced.calls, forced.layers) if not layer["output"].passed] == ["6"]
