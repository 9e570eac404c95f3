"""The recipes learnt from twins' tensors, on numbers alone: a fused projection split unequally (grouped
queries), its concatenation back, a transpose, generalised from a two-layer twin to a real model
with other widths and more layers; what does not fit is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db
from dense_bridge.ports import _rules
from dense_bridge.ports._certificate import make


def _twin(rng, heads=4, kv=2, hd=3, hidden=12, layers=2):
    src, dst = {}, {}
    for i in range(layers):
        qkv = rng.standard_normal(((heads + 2 * kv) * hd, hidden)).astype(np.float32)
        up = rng.standard_normal((hidden, 20)).astype(np.float32)  # stored (in, out): Conv1D-like
        src[f"m.layers.{i}.qkv.weight"], src[f"m.layers.{i}.up.weight"] = qkv, up
        q, k, v = np.split(qkv, [heads * hd, (heads + kv) * hd])
        dst[f"m.h.{i}.q.weight"], dst[f"m.h.{i}.k.weight"], dst[f"m.h.{i}.v.weight"] = q, k, v
        dst[f"m.h.{i}.up.weight"] = up.T.copy()
    emb = rng.standard_normal((30, hidden)).astype(np.float32)
    src["m.emb.weight"], dst["m.emb.weight"] = emb, emb.copy()
    return src, dst


def test_a_split_learnt_on_twins_takes_its_widths_from_the_real_shapes():
    rng = np.random.default_rng(0)
    src, dst = _twin(rng)
    recipes = _rules.learn(src, dst)
    q = recipes["m.h.{}.q.weight"]
    assert q.axis == 0 and q.pieces[0].source == "m.layers.{}.qkv.weight" and not q.pieces[0].whole
    assert recipes["m.h.{}.up.weight"].pieces[0].transpose
    # the real model: 8 query heads, 2 kv heads of width 16, hidden 128, four layers
    heads, kv, hd, hidden, layers = 8, 2, 16, 128, 4
    real_src = {"m.emb.weight": (1000, hidden)}
    real_dst = {"m.emb.weight": (1000, hidden)}
    for i in range(layers):
        real_src[f"m.layers.{i}.qkv.weight"] = ((heads + 2 * kv) * hd, hidden)
        real_src[f"m.layers.{i}.up.weight"] = (hidden, 300)
        real_dst.update({f"m.h.{i}.q.weight": (heads * hd, hidden), f"m.h.{i}.k.weight": (kv * hd, hidden),
                         f"m.h.{i}.v.weight": (kv * hd, hidden), f"m.h.{i}.up.weight": (300, hidden)})
    moves = {m.target: m for m in _rules.plan(recipes, set(), set(), real_src, real_dst)}
    assert set(moves) == set(real_dst)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in real_src.items()}
    qkv = arrays["m.layers.3.qkv.weight"]
    for name, want in (("q", qkv[:heads * hd]), ("k", qkv[heads * hd:(heads + kv) * hd]),
                       ("v", qkv[(heads + kv) * hd:])):
        m = moves[f"m.h.3.{name}.weight"]
        (s_key, transpose, start, stop), = m.sources
        sl = [[start, stop], [0, hidden]]
        got = make([(arrays[s_key], sl, transpose)], m.axis, np.dtype(np.float32))
        assert np.array_equal(got, want), name
    m = moves["m.h.2.up.weight"]
    got = make([(arrays[m.sources[0][0]], None, True)], m.axis, np.dtype(np.float32))
    assert np.array_equal(got, arrays["m.layers.2.up.weight"].T)


def test_a_concatenation_learnt_on_twins_sums_the_real_widths():
    rng = np.random.default_rng(1)
    dst, src = _twin(rng)  # the other way: q, k, v concatenated into qkv
    src = {k: v for k, v in src.items() if ".up." not in k}
    dst = {k: v for k, v in dst.items() if ".up." not in k}
    recipes = _rules.learn(src, dst)
    r = recipes["m.layers.{}.qkv.weight"]
    assert r.axis == 0 and [p.source for p in r.pieces] == ["m.h.{}.q.weight", "m.h.{}.k.weight", "m.h.{}.v.weight"]
    real_src = {"m.emb.weight": (50, 64), **{f"m.h.{i}.{n}.weight": (w, 64) for i in range(3)
                                             for n, w in (("q", 64), ("k", 16), ("v", 16))}}
    real_dst = {"m.emb.weight": (50, 64), **{f"m.layers.{i}.qkv.weight": (96, 64) for i in range(3)}}
    moves = _rules.plan(recipes, set(), set(), real_src, real_dst)
    assert len(moves) == 4
    real_dst["m.layers.1.qkv.weight"] = (95, 64)
    with pytest.raises(db.ConversionError, match="concatenate to 96"):
        _rules.plan(recipes, set(), set(), real_src, real_dst)


def test_what_does_not_fit_the_real_checkpoint_is_named():
    rng = np.random.default_rng(2)
    src, dst = _twin(rng)
    recipes = _rules.learn(src, dst)
    real_src = {k: v.shape for k, v in src.items()}
    real_dst = {k: v.shape for k, v in dst.items()}
    with pytest.raises(db.ConversionError, match="no destination tensor uses.*extra"):
        _rules.plan(recipes, set(), set(), {**real_src, "m.extra.weight": (3,)}, real_dst)
    with pytest.raises(db.ConversionError, match="needs source tensor 'm.layers.1.up.weight'"):
        _rules.plan(recipes, set(), set(), {k: s for k, s in real_src.items() if k != "m.layers.1.up.weight"},
                    real_dst)
    with pytest.raises(db.ConversionError, match="no twin tensor of its kind"):
        _rules.plan(recipes, set(), set(), real_src, {**real_dst, "m.new.weight": (4,)})
    # a tensor the library computes (no rearrangement of the source's) is refused on the twins
    with pytest.raises(db.ConversionError, match="no rearrangement"):
        _rules.learn(src, {**dst, "m.scaled.weight": src["m.emb.weight"] * 2})
