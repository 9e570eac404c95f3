"""db.port of a mixture-of-experts model into keras-hub, against keras-hub's own transformers importer.

transformers saves one tensor per expert and projection (``experts.<e>.gate_proj.weight``, (F, H));
keras-hub keeps one expert bank per block, (E, H, 2F): the experts stacked along a new axis, each
the concatenation of its gate and up matrices, transposed. The twins have few experts; the real
model more, so the recipe learnt from the twins must carry to the real expert count. The preset is
loaded by keras-hub's own ``from_preset`` and compared variable for variable with keras-hub's own
import of the transformers directory. Nothing is downloaded; nothing is mocked.
"""
from __future__ import annotations

import re

import numpy as np

import dense_bridge as db

from _port_helpers import keras_hub_or_skip, mlx_lm_or_skip, randomize, transformers_or_skip


def _tiny_moe(transformers, path):
    import torch

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed=0)
    with torch.no_grad():  # values keras-hub's float16 round trip keeps
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save_pretrained(path)
    return model


def _weights(backbone) -> list[tuple[str, np.ndarray]]:
    import keras

    # keras numbers its layers per process (``qwen_sparse_moe_block_14``): the numbers dropped
    return [(re.sub(r"_\d+(?=/|$)", "", v.path.split("/", 1)[-1]), np.asarray(keras.ops.convert_to_numpy(v))) for v in backbone.weights]


def test_an_expert_bank_stacked_from_per_expert_gate_and_up_is_keras_hubs_own_import(tmp_path):
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    _tiny_moe(transformers, tmp_path / "src")
    report = db.port(tmp_path / "src", tmp_path / "preset", to="keras-hub")
    assert report.verification["passed"]
    mine = keras_hub.models.Backbone.from_preset(str(tmp_path / "preset"))
    theirs = keras_hub.models.Backbone.from_preset(str(tmp_path / "src"))  # keras-hub's own importer
    a, b = _weights(mine), _weights(theirs)
    assert [k for k, _ in a] == [k for k, _ in b]
    banks = [k for k, x in a if x.ndim == 3 and x.shape[0] == 6]
    assert banks, "the real model's expert banks hold its 6 experts"
    for (k, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y), k
    assert db.verify_port(tmp_path / "preset").passed


def test_the_way_back_cuts_every_expert_out_of_the_bank_bit_identical(tmp_path):
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    import torch

    src = _tiny_moe(transformers, tmp_path / "src")
    db.port(tmp_path / "src", tmp_path / "preset", to="keras-hub")
    report = db.port(tmp_path / "preset", tmp_path / "back", to="transformers")
    assert report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert db.verify_port(tmp_path / "back").passed


def test_mlx_lm_gate_and_up_stacks_join_into_the_bank_gate_first(tmp_path):
    """mlx-lm keeps gate and up as two stacks alike in shape and runs up first; keras-hub's bank is
    named after its gate and holds gate, then up: the join follows the name, not the execution."""
    transformers = transformers_or_skip()
    keras_hub = keras_hub_or_skip()
    mlx_lm_or_skip()
    from pathlib import Path

    from mlx_lm.utils import load_model, save_model

    _tiny_moe(transformers, tmp_path / "src")
    model, _ = load_model(Path(tmp_path / "src"))  # mlx-lm's own load, written by its own saver
    save_model(tmp_path / "mlx", model)
    (tmp_path / "mlx" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    report = db.port(tmp_path / "mlx", tmp_path / "preset", to="keras-hub")
    assert report.source == "mlx-lm" and report.verification["passed"]
    mine = keras_hub.models.Backbone.from_preset(str(tmp_path / "preset"))
    theirs = keras_hub.models.Backbone.from_preset(str(tmp_path / "src"))
    for (k, x), (_, y) in zip(_weights(mine), _weights(theirs)):
        assert np.array_equal(x, y), k


def test_a_preset_whose_importer_reads_keys_transformers_does_not_write_goes_back(tmp_path):
    """keras-hub's importer reads ``head_dim`` and ``num_experts`` from a Qwen3-MoE config, which
    transformers' config class does not write (it names the expert count ``num_local_experts``): the
    way back writes them as the importer reads them, and transformers gets its model back bit for bit."""
    transformers = transformers_or_skip()
    keras_hub_or_skip()
    import torch

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(src, seed=0)
    src.save_pretrained(tmp_path / "src")
    db.port(tmp_path / "src", tmp_path / "preset", to="keras-hub")
    report = db.port(tmp_path / "preset", tmp_path / "back", to="transformers")
    assert report.verification["passed"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    a, b = src.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
