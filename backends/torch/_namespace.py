"""``array_namespace``: the judge's array math (``dense_bridge/testing/_namespace``) in torch, float64
on the model's own device.

``compare_models`` judges a torch model's captures where they are: elementwise allowances,
units, ULP distances and histograms run as torch float64 ops on the model's device (CUDA has
float64), and only the scalars of :meth:`TorchNamespace.scalars` cross to the host, stacked into
one tensor (one synchronisation). Arrays of another device or framework arrive once per compared
quantity: a torch tensor by one ``.to(device)``, a DLPack array on the same device without a
copy, anything else (numpy, a framework without DLPack on this device) by one host-to-device copy.
The operations mirror numpy's semantics where the verdict depends on them: ``median`` averages
the two middle values, ``argmax`` returns the first maximum, ``bins`` counts like
``searchsorted(side="right")`` + ``bincount``.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ._arrays import TORCH_DTYPES

_INTS = {"float16": (torch.int16, 15), "bfloat16": (torch.int16, 15), "float32": (torch.int32, 31),
         "float64": (torch.int64, 63)}
_F64 = torch.float64


class TorchNamespace:
    """float64 torch arrays on ``device`` (a ``torch.device``): the interface of
    ``dense_bridge.testing._namespace.ArrayNamespace``."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"TorchNamespace({self.device})"

    # ------------------------------------------------------------------ arrays in
    def asarray(self, x) -> torch.Tensor:
        """``x`` as float64 on this device: a tensor moved/cast once, a DLPack array of the same
        device viewed, numpy (bfloat16 as ml_dtypes) or a Python number copied in once."""
        if isinstance(x, torch.Tensor):
            if x.dtype == _F64 and x.device == self.device and not x.requires_grad:
                return x  # already judged here (most calls: the judge's own intermediates)
            return x.detach().to(self.device, _F64)
        if not isinstance(x, (np.ndarray, np.generic, float, int)) and hasattr(x, "__dlpack__"):
            try:
                return torch.from_dlpack(x).to(self.device, _F64)
            except Exception:  # noqa: BLE001 - a device torch cannot view (or no DLPack export): via the host
                pass
        arr = np.asarray(x)
        if arr.dtype != np.float64:
            arr = arr.astype(np.float64)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    @staticmethod
    def dtype_name(x) -> str:
        if isinstance(x, torch.Tensor):
            return str(x.dtype).removeprefix("torch.")
        return np.asarray(x).dtype.name

    # ------------------------------------------------------------------ elementwise
    abs = staticmethod(torch.abs)
    sqrt = staticmethod(torch.sqrt)
    square = staticmethod(torch.square)
    isnan = staticmethod(torch.isnan)
    isinf = staticmethod(torch.isinf)
    isfinite = staticmethod(torch.isfinite)
    log10 = staticmethod(torch.log10)

    @staticmethod
    def where(cond, x, y) -> torch.Tensor:
        return torch.where(cond, x, y)  # a Python number on either side stays a scalar: no tensor made

    def broadcast_to(self, x, shape) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = torch.tensor(x, dtype=_F64, device=self.device)
        return torch.broadcast_to(x, tuple(shape))

    def zeros(self, shape) -> torch.Tensor:
        return torch.zeros(tuple(int(d) for d in shape), dtype=_F64, device=self.device)

    @staticmethod
    def zeros_like(x) -> torch.Tensor:
        return torch.zeros_like(x)

    @staticmethod
    def sum(x, axis=None) -> torch.Tensor:
        return x.sum() if axis is None else x.sum(axis)

    @staticmethod
    def mean(x) -> torch.Tensor:
        return x.mean()

    # ------------------------------------------------------------------ ULPs, order statistics
    @staticmethod
    def ordinal(x: torch.Tensor, dtype: str) -> torch.Tensor:
        int_type, sign_bit = _INTS[dtype]
        bits = x.to(TORCH_DTYPES[dtype]).view(int_type).to(torch.int64)
        magnitude = bits & ((1 << sign_bit) - 1)
        return torch.where(bits < 0, -magnitude, magnitude)

    @staticmethod
    def as_float64(i) -> torch.Tensor:
        return i.to(_F64)

    @staticmethod
    def max_median(x: torch.Tensor) -> tuple:
        """(max, median) of the non-NaN values of ``x`` (inf, inf when there are none), 0-d tensors,
        without a host synchronisation: torch sorts NaN last, so the k = non-NaN count values
        come first and the middle ones are gathered at tensor indices."""
        s = torch.sort(x.reshape(-1)).values
        k = (~torch.isnan(s)).sum()
        lo, hi = ((k - 1).clamp(min=0) // 2), k // 2
        hi = hi.clamp(max=max(s.numel() - 1, 0))
        median = (_at(s, lo) + _at(s, hi)) / 2  # numpy's mean of the two middle values (one when k is odd)
        top = _at(s, (k - 1).clamp(min=0))
        none = k == 0
        return torch.where(none, torch.inf, top), torch.where(none, torch.inf, median)

    def bins(self, x: torch.Tensor, edges) -> torch.Tensor:
        e = torch.tensor(edges, dtype=_F64, device=x.device)
        idx = torch.searchsorted(e, x.reshape(-1).contiguous(), right=True)
        return torch.bincount(idx, minlength=len(edges) + 1)

    @staticmethod
    def argmax(x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x.reshape(-1))  # torch returns the first maximum, as numpy

    @staticmethod
    def take(x: torch.Tensor, i) -> torch.Tensor:
        return _at(x.reshape(-1), i)

    # ------------------------------------------------------------------ to the host
    def scalars(self, *values) -> list[float]:
        """Python floats of tensors (every element, flattened in order: 0-d ones and short
        vectors such as a histogram's counts) and numbers: one device-to-host copy of them all."""
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if not tensors:
            return [float(v) for v in values]
        host = iter(torch.cat([t.reshape(-1).to(_F64) for t in tensors]).tolist())
        return [x for v in values
                for x in ([next(host) for _ in range(v.numel())] if isinstance(v, torch.Tensor) else [float(v)])]

    @staticmethod
    def errstate():
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope(self):
        """Where a whole judgement runs. On the CPU, with one intra-op thread: the judge issues
        thousands of small elementwise ops, and on cores other processes also hold, every op's
        barrier across the pool's threads waits for a descheduled one (measured on 2 shared
        cores: 29 s with two threads against 3 s with one). The setting is restored after."""
        if self.device.type != "cpu":
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @staticmethod
    def to_host(x) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            return x.detach().to(_F64).cpu().numpy()
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def size(x) -> int:
        return int(x.numel()) if isinstance(x, torch.Tensor) else int(np.size(x))


def _at(flat: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``flat[i]`` for a 0-d index tensor, 0-d, gathered on the device (indexing with a 0-d tensor
    would read it on the host first)."""
    return flat.index_select(0, i.reshape(1)).reshape(())


def array_namespace(model) -> TorchNamespace | None:
    """The namespace ``compare_models`` judges ``model``'s captures in: float64 torch on the
    device of its first parameter (or buffer); None for a model holding no tensor."""
    for t in model.parameters():
        return TorchNamespace(t.device)
    for t in model.buffers():
        return TorchNamespace(t.device)
    return None
