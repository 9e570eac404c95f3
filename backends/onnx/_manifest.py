"""What the core knows of the ONNX backend without importing onnx (see
``dense_bridge.adapter_kit.Manifest``): onnxruntime runs forward only (no gradients capability),
and ``.onnx`` files carry their whole graph."""
from dense_bridge.adapter_kit import FileFormat, FileNames, Manifest, Match, Probe


def _onnx(probe: Probe) -> Match:
    # a protobuf has no magic number: a ModelProto begins with field 1 (ir_version, a varint: 0x08)
    # or another low field tag; the parser decides the rest (read_model refuses a bad file)
    if not probe.name.endswith(".onnx"):
        return Match.NO
    return Match.LIKELY if probe.head[:1] in (b"\x08", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x3a", b"\x42") \
        else Match.FITS


MANIFEST = Manifest(
    requires=("onnx", "onnxruntime"), install="pip install 'dense-bridge[onnx]'", display="ONNX",
    capabilities=frozenset(),  # onnxruntime runs inference only: traces and captures hold no gradients
    formats=(FileFormat("ONNX model file (.onnx)", container="onnx", sniff=_onnx, extensions=(".onnx",),
                        write_kind="onnx", temp_suffix=".onnx", carries_model=True, stores_metadata=True),),
    layout_note="ONNX layout: MatMul on (in_features, units) initializers, Gemm transB=1 on (units, in_features)",
    file_names=FileNames("weight", "bias", ".", "out_in", "torch's exporters keep nn.Linear weights (out, in)"),
)
