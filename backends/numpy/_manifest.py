"""What the core knows of the numpy reference backend without importing it (see
``dense_bridge.adapter_kit.Manifest``): no file format of its own (its checkpoints are canonical
dense_bridge safetensors files), and a hand-written backward, so gradients."""
from dense_bridge.adapter_kit import Manifest

MANIFEST = Manifest(requires=("numpy",), install="pip install numpy",
                    layout_note="canonical layout: Dense kernel (in_features, units)")
