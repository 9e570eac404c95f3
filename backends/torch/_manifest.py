"""What the core knows of the torch backend without importing torch (see
``dense_bridge.adapter_kit.Manifest``): its state-dict files (zip, legacy pickle, safetensors)
and how each is recognised by content, and PEFT's LoRA adapter directories (``_lora_files.py``)."""
from dense_bridge.adapter_kit import (PORTS, DCP, GRADIENTS, PARALLEL, AdapterFormat, FileFormat, FileNames, Manifest, Match,
                                      Probe)

#: ``torch.save``'s legacy (non-zip) format begins with this number, pickled as a LONG1 of 10 bytes
#: (little-endian) after the protocol marker, so an ordinary pickle (a PaddlePaddle ``.pdparams``,
#: say) is never taken for a torch file.
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _zip_state_dict(probe: Probe) -> Match:
    names = probe.zip_names()
    return Match.CERTAIN if names and any(n.endswith("data.pkl") for n in names) else Match.NO


def _legacy_pickle(probe: Probe) -> Match:
    head = probe.head
    if head[:1] == b"\x80":  # PROTO n, then a FRAME (protocol 4+) of 9 bytes
        head = head[2:]
        if head[:1] == b"\x95":
            head = head[9:]
    return Match.CERTAIN if head.startswith(_LEGACY_MAGIC) or head.startswith(b"L1195470371460388013") \
        else Match.NO


def _safetensors(probe: Probe) -> Match:
    meta = probe.metadata or {}
    tag = meta.get("dense_bridge_backend") or meta.get("format", "")
    return Match.CERTAIN if tag in ("pt", "torch") else Match.DEFAULT  # torch is the usual reading


_PICKLE_ENDINGS = (".pt", ".pth", ".bin")

#: PEFT's save_pretrained: the weights (safetensors by default) and the LoraConfig as JSON
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _pickled_peft(names: frozenset) -> str | None:
    """PEFT's ``safe_serialization=False`` writes ``adapter_model.bin``, a pickle: refused, never opened."""
    pickled = sorted(n for n in names if n.startswith("adapter_model.") and n != PEFT_FILES[0])
    return (f"it holds {pickled}, a pickled PEFT adapter, which dense_bridge does not unpickle: save it as "
            f"safetensors (save_pretrained(safe_serialization=True))") if pickled else None


MANIFEST = Manifest(
    requires=("torch",), install="pip install 'dense-bridge[torch]'", display="torch",
    # PARALLEL: DTensor tensor parallelism; DCP: torch.distributed.checkpoint directories (load_dcp/save_dcp)
    capabilities=frozenset({GRADIENTS, PARALLEL, DCP, PORTS}),
    port_formats=("transformers",),  # whole model directories (db.port): _ports.py
    formats=(
        FileFormat("torch state dict", container="torch-zip", sniff=_zip_state_dict, extensions=_PICKLE_ENDINGS,
                   write_kind="torch-pickle"),
        FileFormat("torch state dict", container="torch-legacy", sniff=_legacy_pickle),
        FileFormat("torch safetensors file", container="safetensors", sniff=_safetensors, safetensors=True,
                   extensions=(".safetensors",), write_kind="safetensors", temp_suffix=".safetensors"),
    ),
    layout_note="torch layout: Linear weight (out_features, in_features), mask like the weight",
    file_names=FileNames("weight", "bias", ".", "out_in", "torch stores Linear weight as (out, in)"),
    model_files=_PICKLE_ENDINGS,
    # transformers' GPT-style Conv1D stores weight (nx, nf) = (in, out) and computes
    # addmm(bias, x, weight) (transformers/pytorch_utils.py)
    linear_layouts=(("transformers.pytorch_utils.Conv1D", "weight", "bias", "in_out"),),
    adapter_formats=(AdapterFormat("peft", files=PEFT_FILES, module="_lora_files", refuse=_pickled_peft),),
)
