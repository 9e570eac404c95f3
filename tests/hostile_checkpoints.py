"""Malformed checkpoints for the hostile-input tests (issue 10), made from real saves.

Each case starts from a valid canonical checkpoint that ``db.save`` wrote (single file or
sharded, float32 or bfloat16) and breaks it in one way an attacker or a broken disk would:
header fields, offsets, lengths, JSON shapes, metadata specs, index entries, shard files.
``make_all(directory)`` writes every case and returns ``{case_id: path to load}``.
"""
from __future__ import annotations

import json
import os
import struct

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
