"""A transformers BERT's parameters transferred into a small Flax NNX port written here, then
compared layer by layer with ``compare_models``. Tiny random config, no download.

The port keeps transformers' attribute paths ("encoder.layer.0.attention.self.query"), so one
identity rule maps every layer, norms and embeddings included (``nnx.Embed``'s ``embedding`` and
``nnx.LayerNorm``'s ``scale`` take torch's ``weight`` through the built-in name table).
"""
from __future__ import annotations

import numpy as np
import pytest

import dense_bridge as db

from conftest import require_backend

require_backend("flax")
require_backend("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

CONFIG = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=12, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


class Embeddings(nnx.Module):
    def __init__(self, c, rngs):
        self.word_embeddings = nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs)
        self.position_embeddings = nnx.Embed(c["max_position_embeddings"], c["hidden_size"], rngs=rngs)
        self.token_type_embeddings = nnx.Embed(c["type_vocab_size"], c["hidden_size"], rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(c["hidden_size"], epsilon=c["layer_norm_eps"], rngs=rngs)

    def __call__(self, ids):
        pos = jnp.arange(ids.shape[-1])[None]
        h = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(jnp.zeros_like(ids))
        return self.LayerNorm(h)


class SelfAttention(nnx.Module):
    def __init__(self, c, rngs):
        d = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.query, self.key, self.value = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))

    def __call__(self, h):
        b, s, d = h.shape
        split = lambda t: t.reshape(b, s, self.heads, d // self.heads).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // self.heads), axis=-1)
        return (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)


class Output(nnx.Module):
    def __init__(self, d_in, d, eps, rngs):
        self.dense = nnx.Linear(d_in, d, rngs=rngs)
        self.LayerNorm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)

    def __call__(self, h, residual):
        return self.LayerNorm(self.dense(h) + residual)


class Attention(nnx.Module):
    def __init__(self, c, rngs):
        self.self = SelfAttention(c, rngs)
        self.output = Output(c["hidden_size"], c["hidden_size"], c["layer_norm_eps"], rngs)

    def __call__(self, h):
        return self.output(self.self(h), h)


class Intermediate(nnx.Module):
    def __init__(self, c, rngs):
        self.dense = nnx.Linear(c["hidden_size"], c["intermediate_size"], rngs=rngs)

    def __call__(self, h):
        return jax.nn.gelu(self.dense(h), approximate=False)  # BERT's "gelu" is the exact one


class Layer(nnx.Module):
    def __init__(self, c, rngs):
        self.attention = Attention(c, rngs)
        self.intermediate = Intermediate(c, rngs)
        self.output = Output(c["intermediate_size"], c["hidden_size"], c["layer_norm_eps"], rngs)

    def __call__(self, h):
        h = self.attention(h)
        return self.output(self.intermediate(h), h)


class Encoder(nnx.Module):
    def __init__(self, c, rngs):
        self.layer = nnx.List([Layer(c, rngs) for _ in range(c["num_hidden_layers"])])

    def __call__(self, h):
        for layer in self.layer:
            h = layer(h)
        return h


class Pooler(nnx.Module):
    def __init__(self, c, rngs):
        self.dense = nnx.Linear(c["hidden_size"], c["hidden_size"], rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.dense(h[:, 0]))


class FlaxBert(nnx.Module):
    def __init__(self, c, rngs):
        self.embeddings = Embeddings(c, rngs)
        self.encoder = Encoder(c, rngs)
        self.pooler = Pooler(c, rngs)

    def __call__(self, input_ids):
        h = self.encoder(self.embeddings(input_ids))
        return h, self.pooler(h)


def test_bert_linear_layers_transfer_into_a_flax_port_and_compare_layer_by_layer():
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    port = FlaxBert(CONFIG, nnx.Rngs(0))
    names = list(db.linear_layers(port))
    assert names == list(db.linear_layers(bert))  # same paths, definition order
    assert len(names) == 2 * 6 + 1
    report = db.transfer(bert, port, mapping=[(r"^(.*)$", r"\1")])  # same paths: every layer, norms too
    moved = {s for s, _, _ in report.moved}
    assert set(names) <= moved and "embeddings.word_embeddings.weight" in moved
    assert "encoder.layer.1.output.LayerNorm.weight" in moved
    np.testing.assert_array_equal(np.asarray(port.encoder.layer[1].intermediate.dense.kernel[...]),
                                  bert.encoder.layer[1].intermediate.dense.weight.detach().numpy().T)

    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 7))
    result = db.testing.compare_models(bert, port, {"input_ids": ids}, mapping={p: p for p in names})
    assert result.passed, str(result)
    assert len(result.layers) == len(names) + 1  # every linear layer, then the model output
    # a wrong port is caught at the layer where it starts
    value = port.encoder.layer[1].attention.self.value
    value.kernel.set_value(value.kernel[...] * 1.01)
    broken = db.testing.compare_models(bert, port, {"input_ids": ids}, mapping={p: p for p in names})
    assert not broken.passed
    assert broken.first_divergence.startswith("encoder.layer.1.attention.self.value") or \
        "encoder.layer.1.attention.self.value" in str(broken)
