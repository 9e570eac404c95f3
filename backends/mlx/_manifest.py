"""What the core knows of the MLX backend without importing mlx (see
``dense_bridge.adapter_kit.Manifest``): MLX-layout safetensors and ``.npz`` files, mlx-lm's quantized
model directories and its LoRA adapter directories (``_lora_files.py``)."""
from dense_bridge.adapter_kit import (PORTS, GRADIENTS, PARALLEL, AdapterFormat, FileFormat, FileNames, Manifest, Match, ModelDir,
                                      Probe)


def _safetensors(probe: Probe) -> Match:
    meta = probe.metadata or {}
    tag = meta.get("dense_bridge_backend") or meta.get("format", "")
    if tag == "mlx":
        return Match.CERTAIN
    names = probe.tensor_names or []
    if names and all(n.startswith("layers.") for n in names):
        return Match.LIKELY  # mlx.nn.Sequential keeps its modules in .layers
    return Match.FITS


def _npz(probe: Probe) -> Match:
    names = probe.zip_names()
    return Match.LIKELY if names and all(n.endswith(".npy") for n in names) else Match.NO


def _quantization(config: dict) -> object:
    """mlx-lm's quantization settings in a model's config.json ({"bits", "group_size", "mode"?,
    per-layer overrides by name}; mlx-lm writes them under "quantization" and, for the Hub,
    "quantization_config"), None in a config without them; checked by ``model_dir_layers``."""
    return config.get("quantization", config.get("quantization_config"))


MANIFEST = Manifest(
    requires=("mlx",), install="pip install 'dense-bridge[mlx]'", display="MLX",
    capabilities=frozenset({GRADIENTS, PARALLEL, PORTS}),  # PARALLEL: mx.distributed column/row layers
    port_formats=("mlx-lm",),  # whole model directories (db.port): _ports.py
    formats=(
        FileFormat("MLX safetensors file", container="safetensors", sniff=_safetensors, safetensors=True,
                   extensions=(".safetensors",), write_kind="safetensors", temp_suffix=".safetensors"),
        # mx.savez appends ".npz" to a name without it
        FileFormat("MLX weights file (.npz)", container="npz", sniff=_npz, extensions=(".npz",), write_kind="npz",
                   temp_suffix=".npz"),
    ),
    model_dirs=(ModelDir("quantized model directory", config="config.json",
                         weights=("model.safetensors.index.json", "model.safetensors"), settings=_quantization),),
    layout_note="MLX layout: Linear weight (out_features, in_features), Bilinear weight (out, in2, in1)",
    file_names=FileNames("weight", "bias", ".", "out_in", "MLX stores Linear weight as (out, in)"),
    # mlx_lm.tuner.utils.load_adapters reads these two files of an adapter directory
    adapter_formats=(AdapterFormat("mlx-lm", files=("adapters.safetensors", "adapter_config.json"),
                                   module="_lora_files"),),
)
