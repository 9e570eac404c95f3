"""What the core knows of the Equinox backend without importing equinox or jax (see
``dense_bridge.adapter_kit.Manifest``): ``eqx.tree_serialise_leaves`` files."""
from dense_bridge.adapter_kit import FileFormat, Manifest, Match, Probe


def _leaves(probe: Probe) -> Match:
    # .npy records one after another, no names: eqx.tree_serialise_leaves
    return Match.LIKELY if probe.head.startswith(b"\x93NUMPY") else Match.NO


# jaxlib: the package of JAX arrays' own type (jax.Array is jaxlib's ArrayImpl), by which dense_bridge
# knows an array of this framework wherever one is passed (its NaN/Inf check on its device, DLPack moves)
MANIFEST = Manifest(
    requires=("equinox", "jax", "jaxlib"), install="pip install 'dense-bridge[equinox]'", display="Equinox",
    formats=(FileFormat("Equinox leaves file (.eqx)", container="eqx", sniff=_leaves, extensions=(".eqx",),
                        write_kind="eqx", temp_suffix=".eqx"),),
    layout_note="Equinox layout: unnamed records in the model's leaf order, Linear weight (out_features, "
                "in_features), the mask as a bool record",
)
