"""Malformed checkpoints for the hostile-input tests, made from real saves.

Each case starts from a valid canonical checkpoint that ``db.save`` wrote (single file or
sharded, float32 or bfloat16) and breaks it in one way an attacker or a broken disk would:
header fields, offsets, lengths, JSON shapes, metadata specs, index entries, shard files.
``make_all(directory)`` writes every case and returns ``{case_id: path to load}``.

``H5`` breaks a Keras ``.weights.h5`` (written by dense_bridge, spec attribute included) for the
reader that serves its datasets without a Keras model (``backends/keras/_files.file_views``):
truncated or corrupt storage, chunked/compressed datasets cut short, datasets that claim more
bytes than the file holds, links and storage in other files, wrong dtypes and shapes.
``make_h5(directory)`` writes those (it needs Keras to write the valid file first).
"""
from __future__ import annotations

import json
import os
import struct

import h5py
import numpy as np

import dense_bridge as db

SPEC = {"float32": db.Sequential([db.Dense(6, in_features=4, activation="relu"), db.Dense(3)]),
        "bfloat16": db.Sequential([db.Dense(6, in_features=4, activation="relu", dtype="bfloat16"),
                                   db.Dense(3, dtype="bfloat16")])}


def read_st(path: str) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: str, header: dict | None, data: bytes, *, raw_header: bytes | None = None,
             length_delta: int = 0) -> None:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) + length_delta) + raw + data)


def tensors(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


# ------------------------------------------------------------------ single-file mutations
# each takes (header, data) of a valid file and returns (header, data, write-kwargs)
def _first(h):
    return tensors(h)[0]


def _last(h):
    return tensors(h)[-1]


def m_bool_offset(h, d):
    h[_first(h)]["data_offsets"][0] = False
    return h, d, {}


def m_float_offset(h, d):
    h[_last(h)]["data_offsets"][1] = float(h[_last(h)]["data_offsets"][1])
    return h, d, {}


def m_begin_after_end(h, d):
    o = h[_last(h)]["data_offsets"]
    o[0], o[1] = o[1], o[0]
    return h, d, {}


def m_end_past_file(h, d):
    h[_last(h)]["data_offsets"][1] += 4096
    return h, d, {}


def m_overlap(h, d):
    a, b = tensors(h)[:2]
    size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
    return h, d, {}


def m_gap(h, d):
    for name in tensors(h)[1:]:
        h[name]["data_offsets"] = [o + 8 for o in h[name]["data_offsets"]]
    first = h[tensors(h)[0]]["data_offsets"][1]
    return h, d[:first] + b"\0" * 8 + d[first:], {}


def m_trailing(h, d):
    return h, d + b"\0" * 16, {}


def m_truncated(h, d):
    return h, d[:-3], {}


def m_length_short(h, d):
    return h, d, {"length_delta": -1}


def m_length_long(h, d):
    return h, d, {"length_delta": 1}


def m_length_huge(h, d):
    return h, d, {"length_delta": 2**40}


def m_shape_bytes(h, d):
    h[_first(h)]["shape"][0] += 1
    return h, d, {}


def m_shape_huge(h, d):
    h[_first(h)]["shape"] = [2**31, 2**31, 2**31]
    return h, d, {}


def m_shape_bool(h, d):
    h[_first(h)]["shape"] = [True] + h[_first(h)]["shape"][1:]
    return h, d, {}


def m_shape_negative(h, d):
    h[_first(h)]["shape"][0] = -h[_first(h)]["shape"][0]
    return h, d, {}


def m_dtype_list(h, d):
    h[_first(h)]["dtype"] = [h[_first(h)]["dtype"]]
    return h, d, {}


def m_dtype_unknown(h, d):
    h[_first(h)]["dtype"] = "F128"
    return h, d, {}


def m_missing_field(h, d):
    del h[_first(h)]["data_offsets"]
    return h, d, {}


def m_deep_json(h, d):
    return None, d, {"raw_header": b'{"x":' + b"[" * 50000 + b"]" * 50000 + b"}"}


def m_huge_int(h, d):
    return None, d, {"raw_header": json.dumps(h).replace('"shape": [', '"shape": [' + "9" * 5000 + ", ", 1).encode()}


def m_duplicate_key(h, d):
    text = json.dumps(h)
    name = _first(h)
    entry = json.dumps({name: h[name]})[1:-1]
    return None, d, {"raw_header": (text[:-1] + ", " + entry + "}").encode()}


def m_not_utf8(h, d):
    return None, d, {"raw_header": json.dumps(h).encode()[:-1] + b'"\xff\xfe": 1}'}


def m_metadata_list(h, d):
    h["__metadata__"] = [h["__metadata__"]]
    return h, d, {}


def _spec_meta(h, config) -> None:
    h["__metadata__"]["spec"] = json.dumps(config)


def m_spec_1d_mask(h, d):
    _spec_meta(h, {"class_name": "Dense", "config": {"units": 6, "in_features": 4,
                                                      "mask": {"shape": [24], "packbits_base64": "AAAA"}}})
    return h, d, {}


def m_spec_huge_mask(h, d):
    _spec_meta(h, {"class_name": "Dense", "config": {"units": 60000, "in_features": 60000,
                                                      "mask": {"shape": [60000, 60000], "packbits_base64": "AAAA"}}})
    return h, d, {}


def m_spec_deep(h, d):
    h["__metadata__"]["spec"] = "[" * 100000 + "]" * 100000
    return h, d, {}


def m_spec_huge_units(h, d):
    _spec_meta(h, {"class_name": "Dense", "config": {"units": 10**12, "in_features": 10**6}})
    return h, d, {}


def m_spec_not_json(h, d):
    h["__metadata__"]["spec"] = "{not json"
    return h, d, {}


def m_spec_wrong_class(h, d):
    _spec_meta(h, {"class_name": ["Dense"], "config": {}})
    return h, d, {}


def m_format_version(h, d):
    h["__metadata__"]["format_version"] = "999"
    return h, d, {}


SINGLE = {name[2:]: fn for name, fn in globals().items() if name.startswith("m_")}


# ------------------------------------------------------------------ sharded mutations
# each takes (index path, index dict, shard paths) of a valid sharded save; edits files in place
def s_weight_map_list(index_path, index, shards):
    index["weight_map"] = list(index["weight_map"].items())
    return index


def s_shard_missing(index_path, index, shards):
    os.remove(shards[-1])
    return index


def s_shard_escapes(index_path, index, shards):
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../" + index["weight_map"][name]
    return index


def s_shard_absolute(index_path, index, shards):
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = os.path.abspath(shards[0])
    return index


def s_shard_lacks_tensor(index_path, index, shards):
    names = list(index["weight_map"])
    index["weight_map"][names[0]] = index["weight_map"][names[-1]] if len(set(index["weight_map"].values())) > 1 \
        else "x.safetensors"
    return index


def s_shard_extra_tensor(index_path, index, shards):
    del index["weight_map"][next(iter(index["weight_map"]))]
    return index


def s_shard_overlap(index_path, index, shards):
    header, data = read_st(shards[0])
    if len(tensors(header)) < 2:
        header, data, _ = m_end_past_file(header, data)
    else:
        header, data, _ = m_overlap(header, data)
    write_st(shards[0], header, data)
    return index


def s_shard_truncated(index_path, index, shards):
    with open(shards[0], "r+b") as f:
        f.truncate(os.path.getsize(shards[0]) - 2)
    return index


def s_shard_fifo(index_path, index, shards):
    os.remove(shards[0])
    os.mkfifo(shards[0])
    return index


def s_shard_directory(index_path, index, shards):
    os.remove(shards[0])
    os.mkdir(shards[0])
    return index


def s_shard_is_index(index_path, index, shards):
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = os.path.basename(index_path)
    return index


def s_index_not_object(index_path, index, shards):
    return [index]


def s_index_deep(index_path, index, shards):
    return None  # written raw below


def s_index_huge_int(index_path, index, shards):
    index["metadata"]["total_size"] = "__HUGE__"  # json.dumps cannot write it: replaced when written
    return index


def s_index_shard_name_type(index_path, index, shards):
    index["weight_map"][next(iter(index["weight_map"]))] = 7
    return index


SHARDED = {name[2:]: fn for name, fn in globals().items() if name.startswith("s_")}


def make_all(directory: str) -> dict[str, str]:
    """Write every malformed case under ``directory``; return case id -> the path to load."""
    cases = {}
    for dtype, spec in SPEC.items():
        params = db.get_params(db.compile(spec, "numpy", seed=0))
        for name, mutate in SINGLE.items():
            path = os.path.join(directory, f"single-{dtype}-{name}.safetensors")
            db.save((spec, params), path)
            header, data = read_st(path)
            header, data, kw = mutate(header, data)
            write_st(path, header, data, **kw)
            cases[f"single-{dtype}-{name}"] = path
        for name, mutate in SHARDED.items():
            sub = os.path.join(directory, f"sharded-{dtype}-{name}")
            os.mkdir(sub)
            files = db.save((spec, params), os.path.join(sub, "model.safetensors"), max_shard_size=40)
            index_path, shards = files[-1], files[:-1]
            with open(index_path) as f:
                index = json.load(f)
            index = mutate(index_path, index, shards)
            with open(index_path, "w") as f:
                if index is None:
                    f.write('{"weight_map":' + "[" * 50000 + "]" * 50000 + "}")
                else:
                    f.write(json.dumps(index).replace('"__HUGE__"', "9" * 5000))
            cases[f"sharded-{dtype}-{name}"] = index_path
    return cases


# ------------------------------------------------------------------ Keras .weights.h5 mutations
# each takes the path of a valid weights file (first layer "layers/dense_bridge_dense") and breaks it in place
KERNEL = "layers/dense_bridge_dense/vars/0"
BIAS = "layers/dense_bridge_dense/vars/1"


def _datasets(path: str) -> dict[str, tuple[np.ndarray, dict]]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (obj[()], dict(obj.attrs)))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _rebuild(path: str, make=None) -> None:
    """Rewrite ``path`` with every dataset made by ``make(f, name, data, attrs)`` (None: the
    dataset as it was, contiguous); root attributes and empty groups are kept."""
    with h5py.File(path, "r") as f:
        root = dict(f.attrs)
        groups = []
        f.visititems(lambda name, obj: groups.append(name) if isinstance(obj, h5py.Group) else None)
    datasets = _datasets(path)
    os.remove(path)
    with h5py.File(path, "w") as f:
        f.attrs.update(root)
        for g in groups:
            f.require_group(g)
        for name, (data, attrs) in datasets.items():
            if make is None or make(f, name, data, attrs) is None:
                f.create_dataset(name, data=data).attrs.update(attrs)


def _offset(path: str, name: str) -> int:
    with h5py.File(path, "r") as f:
        return f[name].id.get_offset()


def _chunk_offset(path: str, name: str) -> int:
    with h5py.File(path, "r") as f:
        return f[name].id.get_chunk_info(0).byte_offset


def _all(how):
    return lambda f, name, data, attrs: f.create_dataset(name, data=data, **(how if data.ndim else {})
                                                         ).attrs.update(attrs) or True


def _only(target: str, fn):
    return lambda f, name, data, attrs: fn(f, name, data, attrs) or True if name == target else None


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def h_empty(path):
    _truncate(path, 0)


def h_truncated_header(path):
    _truncate(path, 600)


def h_not_hdf5(path):
    with open(path, "wb") as f:
        f.write(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)


def h_truncated_data(path):
    _rebuild(path)  # the datasets' bytes after the metadata, the kernel last
    _truncate(path, max(_offset(path, KERNEL), _offset(path, BIAS)) + 2)


def h_truncated_chunk(path):
    _rebuild(path, _all({"chunks": True}))
    _truncate(path, _chunk_offset(path, KERNEL) + 2)


def h_truncated_gzip(path):
    _rebuild(path, _all({"chunks": True, "compression": "gzip"}))
    _truncate(path, _chunk_offset(path, KERNEL) + 4)


def h_corrupt_gzip(path):
    _rebuild(path, _all({"chunks": True, "compression": "gzip"}))
    at = _chunk_offset(path, KERNEL)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 8)


def h_unallocated(path):
    """The kernel's shape and dtype as the spec says, but no bytes stored for it at all."""
    _rebuild(path, _only(KERNEL, lambda f, name, data, attrs:
                         f.create_dataset(name, shape=data.shape, dtype=data.dtype).attrs.update(attrs)))


def h_missing_chunks(path):
    """Chunked kernel of which only the first chunk is stored (the rest would read as fill)."""
    def make(f, name, data, attrs):
        made = f.create_dataset(name, shape=data.shape, dtype=data.dtype, chunks=(1,) + data.shape[1:])
        made[0] = data[0]
        made.attrs.update(attrs)
    _rebuild(path, _only(KERNEL, make))


def h_huge_unallocated(path):
    """A 2 KB file whose spec and datasets claim a 60000 x 60000 kernel (14 GB float32, never stored)."""
    with h5py.File(path, "a") as f:
        spec = json.loads(f.attrs["dense_bridge_spec"])
        first = spec["config"]["layers"][0]["config"]
        first["units"] = first["in_features"] = spec["config"]["in_features"] = 60000
        spec["config"]["layers"][1]["config"]["in_features"] = 60000
        f.attrs["dense_bridge_spec"] = json.dumps(spec)
        dtype, attrs = f[KERNEL].dtype, dict(f[KERNEL].attrs)
        for name, shape in ((KERNEL, (60000, 60000)), (BIAS, (60000,)), ("layers/dense/vars/0", (60000, 3))):
            del f[name]
            f.create_dataset(name, shape=shape, dtype=dtype, chunks=True).attrs.update(attrs)


def h_external_link(path):
    other = path + ".other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=_datasets(path)[KERNEL][0])
    with h5py.File(path, "a") as f:
        del f[KERNEL]
        f[KERNEL] = h5py.ExternalLink(os.path.basename(other), "x")


def h_soft_link(path):
    with h5py.File(path, "a") as f:
        data, attrs = f[KERNEL][()], dict(f[KERNEL].attrs)
        f.create_dataset("elsewhere", data=data).attrs.update(attrs)
        del f[KERNEL]
        f[KERNEL] = h5py.SoftLink("/elsewhere")


def h_external_storage(path):
    data, attrs = _datasets(path)[KERNEL]
    raw = path + ".raw"
    with open(raw, "wb") as f:
        f.write(data.tobytes())
    _rebuild(path, _only(KERNEL, lambda f, name, d, a: f.create_dataset(
        name, shape=d.shape, dtype=d.dtype, external=[(raw, 0, d.nbytes)]).attrs.update(a)))


def h_virtual(path):
    data, attrs = _datasets(path)[KERNEL]
    other = path + ".source.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=data)
    layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
    layout[...] = h5py.VirtualSource(other, "x", shape=data.shape)
    with h5py.File(path, "a") as f:
        del f[KERNEL]
        f.create_virtual_dataset(KERNEL, layout).attrs.update(attrs)


def _replace(path, name, make) -> None:
    with h5py.File(path, "a") as f:
        data, attrs = f[name][()], dict(f[name].attrs)
        del f[name]
        make(f, data, attrs)


def h_int_kernel(path):
    _replace(path, KERNEL, lambda f, d, a: f.create_dataset(KERNEL, data=np.arange(d.size, dtype=np.int64)
                                                            .reshape(d.shape)))


def h_float64_kernel(path):
    _replace(path, KERNEL, lambda f, d, a: f.create_dataset(KERNEL, data=np.ones(d.shape, np.float64)))


def h_string_kernel(path):
    _replace(path, KERNEL, lambda f, d, a: f.create_dataset(KERNEL, data=np.full(d.shape, b"x", dtype="S1")))


def h_dtype_attr_lies(path):
    """4-byte floats whose "dtype" attribute says bfloat16 (or bfloat16 saying float32)."""
    def make(f, d, a):
        if a.get("dtype") == "bfloat16":
            f.create_dataset(KERNEL, data=np.ones(d.shape, np.float16)).attrs["dtype"] = "float32"
        else:
            f.create_dataset(KERNEL, data=d).attrs["dtype"] = "bfloat16"
    _replace(path, KERNEL, make)


def h_dtype_attr_list(path):
    with h5py.File(path, "a") as f:
        f[KERNEL].attrs["dtype"] = [1, 2, 3]


def h_transposed_kernel(path):
    _replace(path, KERNEL, lambda f, d, a: f.create_dataset(KERNEL, data=np.ascontiguousarray(d.T)).attrs.update(a))


def h_scalar_kernel(path):
    _replace(path, KERNEL, lambda f, d, a: f.create_dataset(KERNEL, data=d.reshape(-1)[0]).attrs.update(a))


def h_missing_kernel(path):
    with h5py.File(path, "a") as f:
        del f[KERNEL]


def h_group_for_kernel(path):
    with h5py.File(path, "a") as f:
        del f[KERNEL]
        f.create_group(KERNEL)


def h_extra_dataset(path):
    with h5py.File(path, "a") as f:
        f.create_dataset("layers/dense_bridge_dense/vars/2", data=np.zeros((4, 6), np.float32))


def h_spec_not_json(path):
    with h5py.File(path, "a") as f:
        f.attrs["dense_bridge_spec"] = "{not json"


def h_spec_deep(path):
    with h5py.File(path, "a") as f:
        f.attrs["dense_bridge_spec"] = "[" * 100000 + "]" * 100000


def h_spec_not_utf8(path):
    with h5py.File(path, "a") as f:
        f.attrs["dense_bridge_spec"] = np.void(b"\xff\xfe{")


def h_spec_1d_mask(path):
    with h5py.File(path, "a") as f:
        f.attrs["dense_bridge_spec"] = json.dumps(
            {"class_name": "Dense", "config": {"units": 6, "in_features": 4,
                                               "mask": {"shape": [24], "packbits_base64": "AAAA"}}})


def h_spec_huge_units(path):
    with h5py.File(path, "a") as f:
        f.attrs["dense_bridge_spec"] = json.dumps({"class_name": "Dense",
                                                   "config": {"units": 10**12, "in_features": 10**6}})


def h_fifo(path):
    os.remove(path)
    os.mkfifo(path)


def h_directory(path):
    os.remove(path)
    os.mkdir(path)


H5 = {name[2:]: fn for name, fn in globals().items() if name.startswith("h_")}


def make_h5(directory: str) -> dict[str, str]:
    """Write every malformed ``.weights.h5`` case under ``directory`` (needs Keras); return
    case id -> the path to load."""
    from dense_bridge.checkpoints import _native as native

    cases = {}
    for dtype, spec in SPEC.items():
        model = db.compile(spec, "keras", seed=0)
        for name, mutate in H5.items():
            path = os.path.join(directory, f"h5-{dtype}-{name}.weights.h5")
            native.write_native(model, "keras", path, spec=spec)
            mutate(path)
            cases[f"h5-{dtype}-{name}"] = path
    return cases


def make_h5_bomb(directory: str) -> str:
    """A ~50 MB ``.weights.h5`` whose spec and gzip datasets hold a 114688^2 float32 kernel
    (49 GiB of zeros, more than any test machine has): every chunk stored, so only the memory
    limit can refuse it. Chunks are written pre-compressed (``write_direct_chunk``)."""
    import zlib

    from dense_bridge.checkpoints import _native as native

    spec = SPEC["float32"]
    path = os.path.join(directory, "h5-bomb.weights.h5")
    native.write_native(db.compile(spec, "keras", seed=0), "keras", path, spec=spec)
    n, c = 114688, 16384
    pack = zlib.compressobj(9)
    block = bytes(16 << 20)
    chunk = b"".join(pack.compress(block) for _ in range(c * c * 4 // len(block))) + pack.flush()
    with h5py.File(path, "a") as f:
        config = json.loads(f.attrs["dense_bridge_spec"])["config"]
        config["in_features"] = config["layers"][1]["config"]["in_features"] = n
        config["layers"][0]["config"].update(units=n, in_features=n)
        f.attrs["dense_bridge_spec"] = json.dumps({"class_name": "Sequential", "config": config})
        for name in (KERNEL, BIAS, "layers/dense/vars/0"):
            del f[name]
        kernel = f.create_dataset(KERNEL, shape=(n, n), dtype="f4", chunks=(c, c), compression="gzip")
        for i in range(0, n, c):
            for j in range(0, n, c):
                kernel.id.write_direct_chunk((i, j), chunk)
        f.create_dataset(BIAS, data=np.zeros(n, "f4"))
        f.create_dataset("layers/dense/vars/0", data=np.zeros((n, 3), "f4"))
    return path
