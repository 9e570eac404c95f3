"""A text model transformers builds only inside its multimodal composite (no causal language model
of its own for the text sub-config: Qwen2-VL's ``qwen2_vl_text``), ported from the whole
checkpoint with ``text_only=True`` into mlx-lm (whose composite builds the text model alone and
drops the vision tower when it loads the checkpoint): the text weights bit for bit as mlx-lm's own
loader makes them, the vision tower listed as dropped. The other way the destination would need the
vision tower the source lacks: refused, naming it. Also: a text config transformers maps only to its
image-text-to-text auto class (Mistral 4's causal LM) builds as the port's twin, and a multimodal
rope's sections are shrunk with the head. Real transformers and mlx-lm, tiny configs, no downloads.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dense_bridge as db

from _port_helpers import mlx_lm_or_skip, randomize, transformers_or_skip


def _qwen2_vl(transformers, path):
    import torch

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    # a tied head: transformers 5 keeps the setting at the composite's top level only, and mlx-lm's own loader,
    # reading the text config, would otherwise want an untied head from the whole checkpoint
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                     image_token_id=95, video_token_id=94, vision_start_token_id=93,
                                     vision_end_token_id=92)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    randomize(model, seed=0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    path = tmp_path_factory.mktemp("qwen2vl") / "src"
    return transformers, _qwen2_vl(transformers, path), path


def _mlx_params(model):
    from mlx.utils import tree_flatten

    return {k: np.asarray(v) for k, v in tree_flatten(model.parameters())}


def test_the_text_part_ports_into_mlx_lm_as_its_own_loader_reads_it(qwen2_vl, tmp_path):
    from mlx_lm.utils import load_model

    _, _, src = qwen2_vl
    with pytest.raises(db.ConversionError, match=r"multimodal checkpoint \(vision_config"):
        db.port(src, tmp_path / "refused", to="mlx-lm", verify="twins")
    assert not (tmp_path / "refused").exists()
    report = db.port(src, tmp_path / "mlx", to="mlx-lm", verify="twins", text_only=True)
    assert report.verification["passed"] and not report.discrepancies
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    want, _ = load_model(Path(src), model_config=config)  # mlx-lm's own conversion of the whole checkpoint
    got, _ = load_model(Path(tmp_path / "mlx"))
    want, got = _mlx_params(want), _mlx_params(got)
    assert got.keys() == want.keys() and not any(k.endswith("lm_head.weight") for k in got)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # the vision tower: every stored tensor of it listed as dropped, none ported, none silently lost
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "np") as f:
        stored = set(f.keys())
    source = report.certificate["source"]
    assert source["text_only"] is True and source["multimodal_architecture"] == ["Qwen2VLForConditionalGeneration"]
    dropped = set(report.dropped)
    used = {s["tensor"] for t in report.certificate["tensors"].values() for s in t["sources"]}
    assert dropped and all(k.startswith("visual.") for k in dropped) and source["dropped"]["count"] == len(dropped)
    assert used | dropped == stored and not used & dropped
    assert db.verify_port(tmp_path / "mlx").passed


def test_into_transformers_the_missing_vision_tower_is_refused_by_name(qwen2_vl, tmp_path):
    from mlx_lm.utils import load_model, save_model

    _, _, src = qwen2_vl
    # mlx-lm's own conversion: its text model's weights, the checkpoint's config (vision settings kept)
    model, config = load_model(Path(src))
    save_model(tmp_path / "m", model)
    config.pop("quantization_config", None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert config.get("vision_config")
    with pytest.raises(db.ConversionError, match=r"'qwen2_vl_text' only inside Qwen2VLForConditionalGeneration "
                                                 r"\(model_type 'qwen2_vl'\).*vision_config.*nothing was written"):
        db.port(tmp_path / "m", tmp_path / "out", to="transformers", verify="twins")
    assert not (tmp_path / "out").exists()


def test_an_mlx_lm_directory_naming_towers_it_holds_no_weights_of_reads_as_its_text_model(qwen2_vl, tmp_path):
    from mlx_lm.utils import load_model, save_model

    from dense_bridge.backends.mlx import _ports as mp

    _, _, src = qwen2_vl
    model, config = load_model(Path(src))
    save_model(tmp_path / "m", model)
    config.pop("quantization_config", None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    contents = mp.port_contents("mlx-lm", str(tmp_path / "m"))
    assert contents["weights"] and all(k.startswith("language_model.") for k in contents["weights"])
    # a tensor of the tower beside them: the directory is multimodal, refused as before
    from safetensors.numpy import save_file

    save_file({"vision_tower.patch.weight": np.zeros((2, 2), np.float32)},
              str(tmp_path / "m" / "model-extra.safetensors"), metadata={"format": "mlx"})
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"]["vision_tower.patch.weight"] = "model-extra.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(db.ConversionError, match=r"multimodal checkpoint \(vision_config"):
        mp.port_contents("mlx-lm", str(tmp_path / "m"))


def test_a_multimodal_rope_s_sections_split_the_twin_s_head_in_proportion():
    transformers_or_skip()
    from dense_bridge.backends.torch import _ports as tp

    common = {"model_type": "qwen2_vl_text", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128,
              "num_key_value_heads": 8, "intermediate_size": 11008, "num_hidden_layers": 4, "vocab_size": 1000,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}}
    small = tp.port_shrink("transformers", common)
    sections = small["rope_parameters"]["mrope_section"]
    assert sum(sections) == small["head_dim"] // 2 and len(sections) == 3 and all(s >= 1 for s in sections)
    # a list that does not split the head is left as it is
    other = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [3, 4]})
    assert tp.port_shrink("transformers", other)["rope_parameters"]["mrope_section"] == [3, 4]


def test_a_text_model_filed_only_under_image_text_to_text_builds_as_the_twin():
    transformers = transformers_or_skip()
    if "mistral4" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Mistral 4")
    from dense_bridge.backends.torch import _ports as tp

    d = {k: v for k, v in tp._plain_floats(transformers.CONFIG_MAPPING["mistral4"]().to_dict()).items()
         if k != "transformers_version"}
    small = tp.port_shrink("transformers", dict(d, model_type="mistral4"))
    twin = tp.port_twin("transformers", small)
    assert twin.get_output_embeddings() is not None and type(twin).__name__.endswith("ForCausalLM")
    assert set(tp.port_shapes("transformers", small)) == set(twin.state_dict())


def test_an_untied_head_set_at_the_composite_s_top_level_is_carried_with_the_text_config(tmp_path):
    transformers = transformers_or_skip()
    mlx_lm_or_skip()
    import torch

    from dense_bridge.backends.torch import _ports as tp

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    whole = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    randomize(whole, seed=0)
    whole.save_pretrained(tmp_path / "src")
    assert "tie_word_embeddings" not in json.loads((tmp_path / "src" / "config.json").read_text())["text_config"]
    contents = tp.port_contents("transformers", str(tmp_path / "src"), text_only=True)
    assert contents["config"]["tie_word_embeddings"] is False and "lm_head.weight" in contents["weights"]
    report = db.port(tmp_path / "src", tmp_path / "mlx", to="mlx-lm", verify="twins", text_only=True)
    head = report.certificate["tensors"]["language_model.lm_head.weight"]
    assert [s["tensor"] for s in head["sources"]] == ["lm_head.weight"] and head["exact"]


def test_a_tower_width_the_composite_requires_to_be_the_text_width_follows_the_shrunk_text():
    transformers = transformers_or_skip()
    if "muse_spark" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Muse Spark")
    from dense_bridge.backends.torch import _ports as tp

    whole_cls = transformers.CONFIG_MAPPING["muse_spark"]
    text = {k: v for k, v in tp._plain_floats(whole_cls().text_config.to_dict()).items() if k != "transformers_version"}
    small = tp.port_shrink("transformers", text)
    found = tp._composite(small)
    assert found is not None and found[0] is whole_cls
    kw = tp._towers_shrunk(whole_cls, found[1], small)
    # its audio encoder's output is scattered onto the text embeddings: the composite validates the match
    assert kw["audio_config"]["out_hidden_size"] == small["hidden_size"] != whole_cls().audio_config.out_hidden_size
    whole_cls(**kw)
