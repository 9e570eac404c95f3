"""What the core knows of the Flax NNX backend without importing flax or jax (see
``dense_bridge.adapter_kit.Manifest``): ``flax.serialization`` msgpack state files."""
from dense_bridge.adapter_kit import GRADIENTS, PARALLEL, FileFormat, Manifest, Match, Probe


def _msgpack(probe: Probe) -> Match:
    # msgpack has no magic: a map (fixmap 0x81-0x8f, map16, map32) in a file named .msgpack
    first = probe.head[0] if probe.head else -1
    return Match.LIKELY if probe.name.endswith(".msgpack") and (0x81 <= first <= 0x8F or first in (0xDE, 0xDF)) \
        else Match.NO


# jaxlib: the package of JAX arrays' own type (jax.Array is jaxlib's ArrayImpl), by which dense_bridge
# knows an array of this framework wherever one is passed (its NaN/Inf check on its device, DLPack moves)
MANIFEST = Manifest(
    requires=("flax", "jax", "jaxlib"), install="pip install 'dense-bridge[flax]'", display="Flax",
    capabilities=frozenset({GRADIENTS, PARALLEL}),  # PARALLEL: sharding annotations on a named mesh axis
    formats=(FileFormat("Flax msgpack state file", container="msgpack", sniff=_msgpack, extensions=(".msgpack",),
                        write_kind="msgpack", temp_suffix=".msgpack"),),
    layout_note="Flax layout: nnx.Linear kernel (in_features, units) under nested names (layers.0.kernel)",
)
