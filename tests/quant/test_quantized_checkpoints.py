"""Checkpoints that keep quantized codes (dense_bridge/checkpoints/_quantized.py): the canonical
checkpoint with codes, MLX's quantized safetensors/.npz, Keras' quantized .weights.h5, mlx-lm's
quantized model directories (checkpoints/_model_dir.py, backends/mlx/_quant_files.py), through db.save/db.load/convert_file and the command line; every
malformed scheme or shape a CheckpointError naming the tensor and the value."""
from __future__ import annotations

import json

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.checkpoints import convert_file
from dense_bridge.cli import _main as cli

from _quant_helpers import tiny_llama_as_mlx_lm_4bit

IN, HID, OUT = 64, 32, 8
CODE_KEYS = ("qkernel", "scale", "offset", "zero", "bias")


def _mx():
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def _torchao():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    return torch, lambda m, bits, group: quantize_(m, IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{bits}"), granularity=PerGroup(group), mapping_type=MappingType.ASYMMETRIC))


def _keras():
    keras = pytest.importorskip("keras")
    from keras.src.quantizers.quantization_config import Int4QuantizationConfig

    return keras, Int4QuantizationConfig


# ----------------------------------------------------------------------------- models holding codes
def mlx_model(mode="affine"):
    """MLX Sequential: 4-bit affine group 32 (or a microscaling mode), ReLU, float Linear."""
    mx, nn = _mx()
    mx.random.seed(0)
    m = nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))
    group = 16 if mode == "nvfp4" else 32
    m.layers[0] = nn.QuantizedLinear.from_linear(m.layers[0], group_size=group, bits=8 if mode == "mxfp8" else 4,
                                                 mode=mode)
    mx.eval(m.parameters())
    return m


def torch_model():
    """torch Sequential: torchao intx 4-bit group 32 (asymmetric), ReLU, float Linear."""
    torch, quantize = _torchao()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, OUT))
    quantize(m[0], 4, 32)
    return m


def keras_model():
    """Keras Sequential: int8 Dense, int4 Dense in groups of 16, float Dense."""
    keras, Int4 = _keras()
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HID), keras.layers.Dense(HID),
                          keras.layers.Dense(OUT)])
    m.layers[0].quantize("int8")
    m.layers[1].quantize("int4", config=Int4(block_size=16))
    return m


def _layer(model, position):
    return model.layers[position] if hasattr(model, "layers") else model[position]


def assert_same_codes(a, b):
    ca, cb = db.get_params(a, quantized=True), db.get_params(b, quantized=True)
    assert ca["quant"] == cb["quant"]
    for k in CODE_KEYS:
        assert (k in ca) == (k in cb), k
        if k in ca:
            np.testing.assert_array_equal(ca[k], cb[k], err_msg=k)


def _float_kernel(layer):
    return db.get_params(layer)["kernel"]


# ----------------------------------------------------------------------------- canonical with codes
def test_canonical_checkpoint_keeps_mlx_codes_and_rebuilds_them_or_their_exact_floats(tmp_path):
    from safetensors import safe_open

    src = mlx_model()
    path = tmp_path / "q.safetensors"
    db.save(src, path)
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        assert f.get_tensor("0.qkernel").dtype == np.uint8 and "0.kernel" not in f.keys()
    assert json.loads(meta["quant"]) == {"0": {"bits": 4, "group_size": 32, "scheme": "affine"}}
    assert json.loads(meta["spec"])["config"]["layers"][0]["class_name"] == "Dense"  # the float function
    spec, params = db.load(path)
    assert params["0.quant"] == db.Quant(4, 32, "affine") and params["0.qkernel"].shape == (IN, HID)
    codes = db.get_params(src.layers[0], quantized=True)
    for k in ("qkernel", "scale", "offset", "bias"):
        np.testing.assert_array_equal(params["0." + k], codes[k])
    back = db.load(path, "mlx")  # the spec's model, its first position MLX's own QuantizedLinear
    assert type(back.layers[0]).__name__ == "QuantizedLinear"
    assert_same_codes(src.layers[0], back.layers[0])
    np.testing.assert_array_equal(db.get_params(back)["2.kernel"], db.get_params(src)["2.kernel"])
    # no backend holds MLX's affine arithmetic elsewhere: float layers with the exact dequantization
    pytest.importorskip("torch")
    for backend in ("numpy", "torch"):
        other = db.load(path, backend)
        np.testing.assert_array_equal(db.get_params(other)["0.kernel"], _float_kernel(src.layers[0]))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_mlx_microscaling_codes_round_trip_through_the_canonical_checkpoint(tmp_path, mode):
    src = mlx_model(mode)
    db.save(src, tmp_path / "q.safetensors")
    back = db.load(tmp_path / "q.safetensors", "mlx")
    assert back.layers[0].mode == mode
    assert_same_codes(src.layers[0], back.layers[0])


def test_torchao_codes_load_as_torchao_and_as_keras_int4_codes_where_exact(tmp_path):
    src = torch_model()
    path = tmp_path / "t.safetensors"
    db.save(src, path)
    _, params = db.load(path)
    assert params["0.qkernel"].dtype == np.int8 and params["0.quant"] == db.Quant(4, 32, "zero_point")
    back = db.load(path, "torch")
    assert type(back[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert_same_codes(src[0], back[0])
    # Keras int4 in groups dequantizes f((q - zero) * scale) too: the codes move into it exactly
    pytest.importorskip("keras")
    keras_model_ = db.load(path, "keras")
    layer = keras_model_.layers[0]
    assert layer.quantization_mode == "int4"
    np.testing.assert_array_equal(_float_kernel(layer), _float_kernel(src[0]))
    np.testing.assert_array_equal(db.get_params(layer, quantized=True)["qkernel"], params["0.qkernel"])
    # MLX's affine arithmetic differs: float, exactly the dequantization
    pytest.importorskip("mlx.core")
    np.testing.assert_array_equal(db.get_params(db.load(path, "mlx"))["0.kernel"], _float_kernel(src[0]))


def test_keras_int8_and_int4_codes_round_trip_through_the_canonical_checkpoint(tmp_path):
    src = keras_model()
    db.save(src, tmp_path / "k.safetensors")
    _, params = db.load(tmp_path / "k.safetensors")
    assert params["0.quant"] == db.Quant(8, None, "divide") and params["1.quant"] == db.Quant(4, 16, "zero_point")
    back = db.load(tmp_path / "k.safetensors", "keras")
    assert [getattr(l, "quantization_mode", None) for l in back.layers] == ["int8", "int4", None]
    for i in (0, 1):
        assert_same_codes(src.layers[i], back.layers[i])
    pytest.importorskip("torch")
    floats = db.get_params(db.load(tmp_path / "k.safetensors", "torch"))
    np.testing.assert_array_equal(floats["0.kernel"], _float_kernel(src.layers[0]))


def test_sharded_canonical_checkpoint_with_codes_and_canonical_conversion_keep_them(tmp_path):
    src = mlx_model()
    files = db.save(src, tmp_path / "s.safetensors", max_shard_size=2000)
    assert len(files) > 2
    back = db.load(files[-1], "mlx")
    assert_same_codes(src.layers[0], back.layers[0])
    convert_file(files[-1], "canonical", tmp_path / "c.safetensors")
    _, params = db.load(tmp_path / "c.safetensors")
    assert params["0.quant"] == db.Quant(4, 32, "affine")


# ----------------------------------------------------------------------------- framework files
def test_mlx_quantized_safetensors_written_in_mlx_layout_and_read_back_without_like(tmp_path):
    from safetensors import safe_open

    src = mlx_model()
    path = tmp_path / "m.safetensors"
    db.save(src, path, format="mlx")
    with safe_open(str(path), "np") as f:
        names = {n: f.get_tensor(n) for n in f.keys()}
    assert names["layers.0.weight"].dtype == np.uint32 and names["layers.0.weight"].shape == (HID, IN * 4 // 32)
    assert {"layers.0.scales", "layers.0.biases", "layers.0.bias", "layers.2.weight"} <= set(names)
    back = db.load(path, "mlx")  # the scheme from the shapes: no like= needed
    assert_same_codes(src.layers[0], back.layers[0])
    pytest.importorskip("torch")
    floats = db.get_params(db.load(path, "torch"))
    np.testing.assert_array_equal(floats["0.kernel"], _float_kernel(src.layers[0]))
    # an MLX file name (.npz) writes MLX's own file too
    db.save(src, tmp_path / "m.npz")
    assert_same_codes(src.layers[0], db.load(tmp_path / "m.npz", "mlx", like=src).layers[0])


def test_convert_file_carries_codes_between_canonical_and_mlx_files(tmp_path):
    src = mlx_model("mxfp4")
    db.save(src, tmp_path / "m.safetensors", format="mlx")
    convert_file(tmp_path / "m.safetensors", "canonical", tmp_path / "c.safetensors")
    _, params = db.load(tmp_path / "c.safetensors")
    assert params["0.quant"] == db.Quant(4, 32, "mxfp4")
    convert_file(tmp_path / "c.safetensors", "mlx", tmp_path / "m2.safetensors")
    assert_same_codes(src.layers[0], db.load(tmp_path / "m2.safetensors", "mlx").layers[0])


def test_keras_quantized_weights_h5_round_trip_and_into_float_frameworks(tmp_path):
    src = keras_model()
    path = tmp_path / "k.weights.h5"
    db.save(src, path)  # a Keras file name: Keras' own file, its int8 kernel and scales
    back = db.load(path, "keras")
    for i in (0, 1):
        assert_same_codes(src.layers[i], back.layers[i])
    pytest.importorskip("torch")
    floats = db.get_params(db.load(path, "torch"))
    for i in (0, 1):
        np.testing.assert_array_equal(floats[f"{i}.kernel"], _float_kernel(src.layers[i]))
    convert_file(path, "canonical", tmp_path / "c.safetensors")
    _, params = db.load(tmp_path / "c.safetensors")
    assert params["1.quant"] == db.Quant(4, 16, "zero_point")


def test_saving_codes_in_a_format_that_cannot_read_them_back_is_refused(tmp_path):
    with pytest.raises(db.CheckpointError,
                       match=r"mlx model holding quantized layers, and its codes go into mlx files only.*format='torch'"):
        db.save(mlx_model(), tmp_path / "x.safetensors", format="torch")
    with pytest.raises(db.CheckpointError,
                       match=r"a torch model holding quantized layers, and torch files are not read back with codes.*"
                             r"format='torch'"):
        db.save(torch_model(), tmp_path / "x.pt", format="torch")  # torchao codes: canonical only
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the command line
def test_cli_inspect_and_convert_show_and_carry_codes(tmp_path, capsys):
    src = mlx_model()
    db.save(src, tmp_path / "q.safetensors")
    assert cli.main(["inspect", str(tmp_path / "q.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "quantized layers (1" in out and "4-bit affine, group 32  in=64 units=32" in out
    assert cli.main(["inspect", "--json", str(tmp_path / "q.safetensors")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["quantized_layers"] == [{"layer": "0", "bits": 4, "group_size": 32, "scheme": "affine",
                                        "in_features": IN, "units": HID}]
    assert cli.main(["convert", str(tmp_path / "q.safetensors"), "--to", "mlx",
                     "-o", str(tmp_path / "m.safetensors")]) == 0
    capsys.readouterr()
    assert_same_codes(src.layers[0], db.load(tmp_path / "m.safetensors", "mlx").layers[0])


# ----------------------------------------------------------------------------- mlx-lm directories
@pytest.fixture(scope="module")
def mlx_lm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    tiny_llama_as_mlx_lm_4bit(root)
    return root / "mlx"


def test_mlx_lm_quantized_directory_reads_as_tensors_and_inspects_with_its_scheme(mlx_lm_dir, capsys):
    spec, tensors = db.load(mlx_lm_dir)
    assert spec is None
    q = "model.layers.0.self_attn.q_proj."
    assert tensors[q + "weight"].dtype == np.uint32 and tensors[q + "weight"].shape == (64, 64 * 4 // 32)
    assert tensors[q + "scales"].shape == tensors[q + "biases"].shape == (64, 2)
    assert cli.main(["inspect", "--json", str(mlx_lm_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["layer"]: r for r in doc["quantized_layers"]}
    assert rows["model.layers.0.self_attn.k_proj"] == {"layer": "model.layers.0.self_attn.k_proj", "bits": 4,
                                                       "group_size": 32, "scheme": "affine", "in_features": 64,
                                                       "units": 32}
    assert "model.embed_tokens" in rows and "lm_head" in rows
    linear = {r["layer"]: r for r in doc["linear_layers"]}
    assert linear["model.layers.0.self_attn.k_proj"]["in_features"] == 64  # not the packed 8 words


def test_mlx_lm_directory_opens_as_a_quantized_directory_of_its_own_class(mlx_lm_dir):
    """The directory is a QuantizedDirectory (a NativeCheckpoint subclass) whose behaviour is its
    class's: nothing is assigned over a method from outside, and the layers come from the MLX
    adapter's model_dir_layers verb (widths read from the packing, not the packed words)."""
    from dense_bridge.checkpoints import open_checkpoint
    from dense_bridge.checkpoints._model_dir import QuantizedDirectory

    with open_checkpoint(mlx_lm_dir) as ckpt:
        assert type(ckpt) is QuantizedDirectory and ckpt.framework == "mlx" and ckpt.spec is None
        methods = {n for n in dir(QuantizedDirectory) if callable(getattr(QuantizedDirectory, n))}
        assert not set(vars(ckpt)) & methods, set(vars(ckpt)) & methods
        # mlx-lm writes an index beside its shards: the directory reads as that index
        assert ckpt.directory == str(mlx_lm_dir) and ckpt.path == str(mlx_lm_dir / "model.safetensors.index.json")
        assert ckpt.index and ckpt.container == "safetensors-index"
        assert ckpt.quant_layers["model.layers.0.self_attn.k_proj"] == (db.Quant(4, 32, "affine"), 64, 32)
        assert ckpt.kind == (f"quantized model directory ({len(ckpt.quant_layers)} quantized layers; "
                             "model.safetensors.index.json + config.json)")
        assert set(ckpt.params()) == {n for n, _, _ in ckpt.entries()}


def _copy_dir(src, dst, config_edit=None):
    import shutil

    shutil.copytree(src, dst)
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["quantization"].update(bits=0), r"bits=0.*bits must be an integer from 1 to 8"),
    (lambda c: c["quantization"].update(bits=8),
     r"'lm_head.weight' \(shape \(64, 8\), uint32\) reads as 8-bit codes in groups of 16"),
    (lambda c: c["quantization"].update(group_size=64), r"hold Quant\(bits=4, group_size=32.*config says "
                                                        r"Quant\(bits=4, group_size=64"),
    (lambda c: c.update(quantization=[4]), r"\"quantization\" must be an object.*Received: quantization=\[4\]"),
])
def test_mlx_lm_directory_with_a_wrong_quantization_config_is_a_checkpoint_error(mlx_lm_dir, tmp_path, edit,
                                                                                 message):
    bad = _copy_dir(mlx_lm_dir, tmp_path / "bad", edit)
    with pytest.raises(db.CheckpointError, match=message):
        db.load(bad)


# ----------------------------------------------------------------------------- hostile files
def _rewrite(path, out, *, meta=None, tensors=None, drop=()):
    """``path``'s safetensors with metadata keys and tensors replaced (numpy only)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), "np") as f:
        all_meta = dict(f.metadata())
        arrays = {n: f.get_tensor(n) for n in f.keys() if n not in drop}
    all_meta.update(meta or {})
    arrays.update(tensors or {})
    save_file(arrays, str(out), metadata=all_meta)
    return out


@pytest.fixture
def canonical_codes(tmp_path):
    src = mlx_model()
    db.save(src, tmp_path / "q.safetensors")
    return tmp_path / "q.safetensors"


def _quant_meta(bits=4, group_size=32, scheme="affine"):
    return {"quant": json.dumps({"0": {"bits": bits, "group_size": group_size, "scheme": scheme}})}


@pytest.mark.parametrize("change, message", [
    (dict(meta=_quant_meta(bits=0)), r"quant\['0'\].*bits.*0.*bits must be an integer from 1 to 8"),
    (dict(meta=_quant_meta(group_size=48)), r"'0.qkernel': group_size 48 does not divide in_features 64"),
    (dict(meta=_quant_meta(scheme="nf4")), r"quant\['0'\].*scheme must be one of.*'nf4'"),
    (dict(meta={"quant": "{not json"}), r"metadata 'quant' \(not valid JSON"),
    (dict(meta={"quant": json.dumps({"5": {"bits": 4, "group_size": 32, "scheme": "affine"}})}),
     r"names position '5', which the spec \(a Sequential of 3 layers\) does not have"),
    (dict(meta={"quant": json.dumps({"1": {"bits": 4, "group_size": 32, "scheme": "affine"}})}),
     r"quantizes position '1', which the spec describes as Activation"),
    (dict(tensors={"0.qkernel": np.zeros((IN // 2, HID), np.uint8)}), r"0.qkernel: file has shape \(32, 32\), the "
                                                                       r"spec expects \(64, 32\)"),
    (dict(tensors={"0.scale": np.zeros((3, HID), np.float32)}), r"0.scale: file has shape \(3, 32\), the spec "
                                                                r"expects \(2, 32\)"),
    (dict(tensors={"0.qkernel": np.zeros((IN, HID), np.float32)}), r"'0.qkernel' holds codes and must be uint8 or "
                                                                   r"int8; the file has float32"),
    (dict(drop=("0.offset",)), r"missing keys \['0.offset'\]"),
    (dict(tensors={"0.qkernel": np.full((IN, HID), 16, np.uint8)}), r"'0.qkernel' holds the code 16, outside the "
                                                                    r"4-bit unsigned range 0..15"),
])
def test_malformed_codes_in_a_canonical_checkpoint_are_checkpoint_errors(canonical_codes, tmp_path, change, message):
    bad = _rewrite(canonical_codes, tmp_path / "bad.safetensors", **change)
    with pytest.raises(db.CheckpointError, match=message):
        _, params = db.load(bad)
    pytest.importorskip("mlx.core")
    with pytest.raises(db.CheckpointError, match=message):
        db.load(bad, "mlx")


@pytest.fixture
def mlx_file(tmp_path):
    db.save(mlx_model(), tmp_path / "m.safetensors", format="mlx")
    return tmp_path / "m.safetensors"


@pytest.mark.parametrize("change, message", [
    (dict(tensors={"layers.0.weight": np.zeros((HID, 7), np.uint32)}),
     r"'layers.0.weight' \(shape \(32, 7\), uint32\) does not pack 64 in_features: 7 words"),
    (dict(tensors={"layers.0.weight": np.zeros((HID, 14), np.uint32)}),
     r"'layers.0.weight' \(shape \(32, 14\), uint32\) reads as 7-bit codes in groups of 32"),
    (dict(tensors={"layers.0.weight": np.zeros((HID, 8), np.int32)}), r"'layers.0.weight'.*must be uint32"),
    (dict(tensors={"layers.0.scales": np.zeros((HID, 3), np.float32),
                   "layers.0.biases": np.zeros((HID, 3), np.float32)}),
     r"'layers.0.scales' \(shape \(32, 3\), float32\) must be \(units, groups\) = \(32, G\) with G dividing "
     r"in_features 64"),
    (dict(tensors={"layers.0.biases": np.zeros((HID, 4), np.float32)}),
     r"'layers.0.biases' \(shape \(32, 4\), float32\) must have the scales' shape \(32, 2\)"),
    (dict(drop=("layers.0.biases",)), r"'layers.0.scales'.*has no biases beside it.*must hold uint8 scales"),
    (dict(drop=("layers.0.weight",)), r"'layers.0.scales' holds quantization scales but the file has no "
                                      r"'layers.0.weight'"),
])
def test_malformed_mlx_quantized_safetensors_are_checkpoint_errors(mlx_file, tmp_path, change, message):
    bad = _rewrite(mlx_file, tmp_path / "bad.safetensors", **change)
    with pytest.raises(db.CheckpointError, match=message):
        db.load(bad, "mlx")


def test_codes_the_backends_quantized_layer_cannot_hold_exactly_load_as_their_exact_floats(tmp_path):
    """Zero points beyond int8 (valid for the canonical form, uint8): torchao builds an intx
    layer for the scheme, the codes do not fit it, and that position loads float, exactly."""
    from dense_bridge.quant import reference_dequantize

    src = torch_model()
    db.save(src, tmp_path / "t.safetensors")
    _, params = db.load(tmp_path / "t.safetensors")
    codes = {k[2:]: v for k, v in params.items() if k.startswith("0.")}
    zero = np.full(codes["zero"].shape, 200, np.uint8)  # codes 0..15 then dequantize far below zero
    qkernel = (codes["qkernel"].astype(np.int16) + 8).astype(np.uint8)
    bad = _rewrite(tmp_path / "t.safetensors", tmp_path / "far.safetensors",
                   tensors={"0.zero": zero, "0.qkernel": qkernel})
    model = db.load(bad, "torch")
    assert type(model[0].weight).__name__ == "Parameter"  # float: the exact dequantization
    want = reference_dequantize({**codes, "zero": zero, "qkernel": qkernel})
    np.testing.assert_array_equal(db.get_params(model)["0.kernel"], want)


def _rewrite_h5(path, out, replace: dict):
    """A copy of the ``.weights.h5`` at ``path`` with datasets replaced (h5py)."""
    import shutil

    h5py = pytest.importorskip("h5py")
    shutil.copy(path, out)
    with h5py.File(out, "a") as f:
        for name, value in replace.items():
            del f[name]
            f[name] = value
    return out


@pytest.mark.parametrize("replace, message", [
    ({"layers/dense/vars/0": np.zeros((IN, 5), np.int8)},
     r"dataset layers/dense/vars/0 \(\(64, 5\), int8\) must hold int8 codes \(64, 32\) or packed int4 codes "
     r"\(64, 16\)"),
    ({"layers/dense/vars/2": np.zeros((3,), np.float32)},
     r"dataset layers/dense/vars/2 \(\(3,\), float32\) must be the int8 scale \(32,\)"),
    ({"layers/dense_1/vars/2": np.zeros((3, HID), np.float32)},
     r"dataset layers/dense_1/vars/2 \(\(3, 32\), float32\) must be the int4 group scale \(G, 32\) with G dividing "
     r"in_features 32"),
    ({"layers/dense_1/vars/3": np.zeros((2, HID), np.float32)},
     r"dataset layers/dense_1/vars/3 \(\(2, 32\), float32\) must be the int4 zero points \(2, 32\) int8"),
])
def test_malformed_keras_quantized_weights_are_checkpoint_errors(tmp_path, replace, message):
    path = tmp_path / "k.weights.h5"
    db.save(keras_model(), path)
    bad = _rewrite_h5(path, tmp_path / "bad.weights.h5", replace)
    with pytest.raises(db.CheckpointError, match=message):
        db.load(bad, "keras")


def test_a_quant_position_named_twice_is_refused_naming_the_file_and_the_position(tmp_path):
    """JSON keeps the last of two equal keys: which scheme a layer's codes follow would be the
    reader's accident. The metadata's ``quant`` object is read refusing duplicate keys."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = mlx_model()
    path = tmp_path / "q.safetensors"
    db.save(src, path)
    with safe_open(str(path), "np") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta["quant"] = ('{"0": {"bits": 4, "group_size": 32, "scheme": "affine"}, '
                     '"0": {"bits": 8, "group_size": 32, "scheme": "affine"}}')
    twice = tmp_path / "twice.safetensors"
    save_file(tensors, str(twice), metadata=meta)
    with pytest.raises(db.CheckpointError, match=r"twice\.safetensors.*quant.*'0' appears twice"):
        db.load(twice)
