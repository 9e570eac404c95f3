"""What the core knows of the Keras 3 backend without importing Keras (see
``dense_bridge.adapter_kit.Manifest``): the engine package it runs on, its priority over the
engine's own adapter, its ``.weights.h5``/``.keras`` files."""
import json
import os

from dense_bridge.adapter_kit import PORTS, GRADIENTS, PARALLEL, AdapterFormat, FileFormat, FileNames, Manifest, Match, Probe


def keras_backend_package() -> str:
    """The package Keras 3 will run on, read as Keras reads it, without importing Keras:
    ``KERAS_BACKEND``, else ``"backend"`` in ``$KERAS_HOME/keras.json`` (``~/.keras``), else
    TensorFlow."""
    name = os.environ.get("KERAS_BACKEND")
    if not name:
        home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
        try:
            with open(os.path.join(home, "keras.json")) as f:
                name = json.load(f).get("backend")
        except (OSError, ValueError, AttributeError):
            name = None
    return {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch", "numpy": "numpy",
            "openvino": "openvino"}.get(str(name or "tensorflow").lower(), str(name))


def _weights(probe: Probe) -> Match:
    return Match.LIKELY if probe.head.startswith(b"\x89HDF\r\n\x1a\n") else Match.NO  # any HDF5 file


def _model(probe: Probe) -> Match:
    names = probe.zip_names()
    return Match.CERTAIN if names and "config.json" in names and any(n.endswith(".weights.h5") for n in names) \
        else Match.NO


MANIFEST = Manifest(
    requires=("keras",), runtime_requires=lambda: (keras_backend_package(),),
    install="pip install 'dense-bridge[keras]'", display="Keras",
    # PARALLEL: ModelParallel with a LayoutMap, on Keras' JAX engine (parallel_compile refuses the others)
    capabilities=frozenset({GRADIENTS, PARALLEL, PORTS}),
    port_formats=("keras-hub",),  # keras-hub preset directories (db.port): _ports.py
    # on its torch engine a Keras layer is also a torch.nn.Module (and with KERAS_NNX_ENABLED a
    # Flax module): it must be read as the Keras layer it is
    owner_priority=10,
    formats=(
        FileFormat("Keras weights file", container="h5", sniff=_weights, extensions=(".weights.h5",),
                   write_kind="keras-weights", temp_suffix=".weights.h5", stores_metadata=True),
        FileFormat("Keras model file (.keras)", container="keras-model", sniff=_model, extensions=(".keras",),
                   write_kind="keras-model", temp_suffix=".keras", carries_model=True),
    ),
    layout_note="Keras layout: Dense kernel (in_features, units) as layers/<name>/vars/0",
    # .weights.h5 names variables by position: "layers/dense/vars/0" is a Dense kernel, "vars/1" its bias
    file_names=FileNames("vars/0", "vars/1", "/", "in_out", "Keras stores Dense kernel as (in, out)"),
    model_files=(".keras",),
    # keras-hub's Backbone.save_lora_weights: one HDF5 file naming adapted layers by index (_lora.py)
    adapter_formats=(AdapterFormat("keras-hub", suffix=".lora.h5", load_verb="load_lora_h5",
                                   save_verb="save_lora_h5"),),
    quiet_import=True,  # TensorFlow's C++ start-up lines bypass TF_CPP_MIN_LOG_LEVEL
)
