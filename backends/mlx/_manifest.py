"""What the core knows of the MLX backend without importing mlx (see
``dense_bridge.adapter_kit.Manifest``): MLX-layout safetensors and ``.npz`` files, and mlx-lm's LoRA
adapter directories (``_lora_files.py``)."""
from dense_bridge.adapter_kit import GRADIENTS, PARALLEL, AdapterFormat, FileFormat, FileNames, Manifest, Match, Probe


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


MANIFEST = Manifest(
    requires=("mlx",), install="pip install 'dense-bridge[mlx]'", display="MLX",
    capabilities=frozenset({GRADIENTS, PARALLEL}),  # PARALLEL: mx.distributed column/row layers
    formats=(
        FileFormat("MLX safetensors file", container="safetensors", sniff=_safetensors, safetensors=True,
                   extensions=(".safetensors",), write_kind="safetensors", temp_suffix=".safetensors"),
        # mx.savez appends ".npz" to a name without it
        FileFormat("MLX weights file (.npz)", container="npz", sniff=_npz, extensions=(".npz",), write_kind="npz",
                   temp_suffix=".npz"),
    ),
    layout_note="MLX layout: Linear weight (out_features, in_features), Bilinear weight (out, in2, in1)",
    file_names=FileNames("weight", "bias", ".", "out_in", "MLX stores Linear weight as (out, in)"),
    # mlx_lm.tuner.utils.load_adapters reads these two files of an adapter directory
    adapter_formats=(AdapterFormat("mlx-lm", files=("adapters.safetensors", "adapter_config.json"),
                                   module="_lora_files"),),
)
