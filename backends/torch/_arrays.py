"""Crossing between numpy and torch memory: dtype names, zero-copy views both ways, copies in.

bfloat16 crosses as ``ml_dtypes.bfloat16`` through an int16 view (numpy has no bf16).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from dense_bridge._dtypes import numpy_dtype
from dense_bridge._errors import ConversionError

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                 "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ConversionError(f"{what} has dtype {dtype}; dense_bridge supports float32, float64, float16 "
                              f"and bfloat16")
    return _DTYPE_NAMES[dtype]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor; for a tensor on another device a writable copy
    nobody else holds (made C-contiguous there, so a transposed view is transposed on the
    device, then one device-to-host copy); bf16 as ml_dtypes."""
    t = t.detach()
    host = t.device.type == "cpu"
    if not host:
        t = t.contiguous().cpu()
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    else:
        arr = t.numpy()
    arr.flags.writeable = not host  # a CPU tensor's memory is torch's: callers copy before mutating
    return arr


def from_numpy(arr: np.ndarray, device=None) -> torch.Tensor:
    """A tensor viewing ``arr`` (no copy) for torch to read from; bf16 through an int16 view.
    ``device`` (a ``torch.device`` or a name :func:`parse_device` reads): a copy placed there
    instead (one host-to-device copy)."""
    if device is not None:
        target = parse_device(device)
        t = from_numpy(arr)
        return t if t.device == target else t.to(target)
    arr = np.asarray(arr)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    bf16 = arr.dtype == numpy_dtype("bfloat16")
    if bf16:
        arr = arr.view(np.int16)
    if any(s < 0 for s in arr.strides):  # torch.from_numpy rejects negative strides
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        # torch warns that a read-only array could be written through the tensor; we only read
        # it (it is the source of a copy_), so viewing it saves a full copy.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if bf16 else t


def copy_in(target: torch.Tensor, value, transpose: bool = False) -> None:
    """Copy canonical ``value`` into ``target`` (transposed for torch's (out, in) layout).

    ``value``: a numpy array (viewed, one host-to-device copy where ``target`` is on a device), a
    tensor on any device or an array of another framework speaking DLPack (a device-to-device
    copy: ``copy_`` casts and transposes on the device)."""
    src = as_tensor(value)
    with torch.no_grad():
        target.copy_(src.t() if transpose else src)


# ----------------------------------------------------------------------------- devices (capability "devices")
def as_tensor(value) -> torch.Tensor:
    """``value`` as a torch tensor without a host round trip: a tensor as it is, an array of another
    framework that speaks DLPack (a JAX array) through ``torch.from_dlpack`` (shared memory: the
    caller copies it into storage it owns), anything else (numpy) viewed by :func:`from_numpy`."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        return torch.from_dlpack(value)
    return from_numpy(value)


def device_name(device: torch.device) -> str:
    """A device as dense_bridge names it: "cpu" or "cuda:N" (the index always given)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return device.type if device.index is None else f"{device.type}:{device.index}"


def device_of(native) -> str | None:
    """Where ``native`` (a module, a tensor) keeps its parameters: "cpu", "cuda:0", ...; None
    when it holds no tensor. A model spread over several devices answers its first parameter's."""
    if isinstance(native, torch.Tensor):
        return device_name(native.device)
    tensors = getattr(native, "parameters", None)
    if tensors is None:
        return None
    for t in native.parameters():
        return device_name(t.device)
    for t in native.buffers():
        return device_name(t.device)
    return None


def parse_device(value, argument: str = "device") -> torch.device:
    """A user's ``device=`` as a ``torch.device``: a ``torch.device`` or one of "cpu", "cuda",
    "cuda:N", "gpu", "gpu:N" ("gpu" is CUDA here). TypeError for another type, SpecError
    (naming ``argument``, echoing the value) for a string torch cannot place tensors on."""
    from dense_bridge._errors import SpecError, received

    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text == "gpu" or text.startswith("gpu:"):
            text = "cuda" + text[3:]
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index not in ("", "0")):
            raise SpecError(f"{argument} must be 'cpu', 'cuda', 'cuda:N', 'gpu', 'gpu:N' or a torch.device. "
                            f"{received(argument, value)}")
        device = torch.device(text)
    else:
        raise TypeError(f"{argument} must be a device name (str) or a torch.device. {received(argument, value)}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise SpecError(f"{argument} names a CUDA device this machine does not have ({count} CUDA device(s) "
                            f"visible to torch). {received(argument, value)}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def nonfinite_flags(arrays) -> list[bool]:
    """Which of ``arrays`` (floating tensors, on any devices) hold NaN or Inf: one reduction per
    tensor on its own device, the tensors of one device and dtype in one fused launch
    (``torch._foreach_norm``), the results of each device tested together, and one host
    synchronisation for the verdict.

    The reduction is the 2-norm: it is finite exactly when every element is finite and the sum
    of their squares does not overflow (NaN propagates, Inf stays Inf), and it is the fused
    kernel every device runs at memory speed (the max-abs, ord=inf, is several times slower on
    the CPU). A tensor whose 2-norm is not finite is then judged exactly by its max-abs: only
    when something is non-finite or large enough for its squares to overflow (|x| >~ 1e19 in
    float32), one more reduction of those tensors and one more synchronisation say which."""
    flags: list[bool] = [False] * len(arrays)
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, a in enumerate(arrays):
        t = as_tensor(a)
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append((i, t))
    by_device: dict[torch.device, list[tuple[list[tuple[int, torch.Tensor]], torch.Tensor]]] = {}
    for (device, _), pairs in groups.items():  # one launch per device and dtype
        tensors = [t for _, t in pairs]
        by_device.setdefault(device, []).append((pairs, torch.isfinite(_norms(tensors, 2.0))))
    for parts in by_device.values():
        finite = torch.cat([f for _, f in parts])
        if bool(finite.all()):  # the one host synchronisation
            continue
        suspects = [p for pairs, _ in parts for p in pairs]  # in the order of ``finite``
        suspects = [p for p, ok in zip(suspects, finite.cpu().tolist()) if not ok]
        exact = torch.isfinite(_norms([t for _, t in suspects], float("inf"))).cpu().tolist()
        for (i, _), ok in zip(suspects, exact):
            flags[i] = not ok
    return flags


def _norms(tensors: list, order: float) -> torch.Tensor:
    """The ``order``-norm of each of ``tensors`` (one device; ord=inf: the max-abs) as one float32
    vector: one fused launch per dtype where torch has the kernel, else one by one."""
    if len({t.dtype for t in tensors}) == 1:  # the usual case (nonfinite_flags groups by dtype): one launch
        try:
            return torch.stack(torch._foreach_norm(tensors, order)).float()
        except (AttributeError, RuntimeError, NotImplementedError):
            return torch.stack([torch.linalg.vector_norm(t, order) for t in tensors]).float()
    found: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(j)
    for idx in by_dtype.values():
        group = [tensors[j] for j in idx]
        try:
            norms = torch._foreach_norm(group, order)
        except (AttributeError, RuntimeError, NotImplementedError):
            norms = [torch.linalg.vector_norm(t, order) for t in group]
        found.update(zip(idx, norms))
    return torch.stack([found[j].float() for j in range(len(tensors))])


def place(native, device):
    """``native`` (a module) with its parameters and buffers moved to ``device`` (a ``torch.device``
    from :func:`parse_device`): one copy per tensor, the module itself returned (moved in place)."""
    return native.to(device)
