"""The small float MLP and its 4-bit MLX twin that the quantized comparisons port between."""
from __future__ import annotations

import pytest

IN, OUT = 64, 8


def float_mlp():
    """torch: Linear(IN, IN) -> ReLU -> Linear(IN, OUT), seeded."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, IN), torch.nn.ReLU(), torch.nn.Linear(IN, OUT))


def empty_mlx_quantized_mlp():
    """MLX: QuantizedLinear(IN, IN) -> ReLU -> QuantizedLinear(IN, OUT), 4-bit, group 32, as MLX
    initialises them (the caller moves weights in); paths layers.0 and layers.2."""
    pytest.importorskip("mlx.core")
    import mlx.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.QuantizedLinear(IN, IN, group_size=32, bits=4), nn.ReLU(),
                           nn.QuantizedLinear(IN, OUT, group_size=32, bits=4)]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return MLP()


def tiny_llama_as_mlx_lm_4bit(root):
    """A 1-layer random Llama saved by transformers under ``root/hf`` (with a word-level
    tokenizer, which ``mlx_lm.convert`` requires), converted by ``mlx_lm.convert(quantize=True)``
    to 4 bits, group 32, under ``root/mlx``. Returns the transformers config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(root / "hf")
    mlx_lm.convert(hf_path=str(root / "hf"), mlx_path=str(root / "mlx"), quantize=True, q_group_size=32, q_bits=4)
    return config
