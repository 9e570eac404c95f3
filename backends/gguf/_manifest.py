"""What the core knows of the GGUF backend without importing anything: a file format (llama.cpp's)
that no framework runs here. It offers the model-directory port verbs only (``port_formats``);
its twins are transformers' models of the file (transformers' own GGUF loader), so it needs gguf,
transformers and torch."""
from dense_bridge.adapter_kit import PORTS, Manifest

MANIFEST = Manifest(
    requires=("gguf", "transformers", "torch"), install="pip install 'dense-bridge[port]'", display="GGUF",
    capabilities=frozenset({PORTS}),
    port_formats=("gguf",),  # single GGUF files (db.port src and out): _ports.py
)
