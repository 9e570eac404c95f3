"""The reference layers and the ``compile``/``owns`` verbs: forward and hand-derived backward."""
from __future__ import annotations

import numpy as np

from dense_bridge.adapter_kit import compute_dtype, numpy_dtype
from dense_bridge.adapter_kit import SpecError, received
from dense_bridge.adapter_kit import ParamSource
from dense_bridge.activations import Activation
from dense_bridge.specs import Bilinear, Dense, Flatten, Identity, Sequential

from ._activations import ActivationLayer, Layer
from ._arrays import as_input


class DenseLayer(Layer):
    """Reference Dense: y = f(x @ (kernel * mask) + bias) for x (*, in_features).

    Attributes: ``kernel`` (in_features, units), ``bias`` (units,) or None, ``mask`` or None,
    all in the layer dtype; after ``backward``: ``grad_kernel``, ``grad_bias``.
    A lazy spec draws its parameters on the first ``forward``.
    """

    def __init__(self, spec: Dense, source: ParamSource, index: int = 0) -> None:
        self.spec = spec
        self._source, self._index = source, index
        self.kernel = self.bias = self.mask = None
        self._cache = None
        self._grads: dict[str, np.ndarray] = {}
        if spec.in_features is not None:
            self._load(source.for_layer(index, spec))

    def _load(self, params: dict[str, np.ndarray]) -> None:
        self.kernel = np.array(params["kernel"], copy=True)
        self.bias = np.array(params["bias"], copy=True) if "bias" in params else None
        self.mask = np.array(params["mask"], copy=True) if "mask" in params else None

    @property
    def built(self) -> bool:
        return self.kernel is not None

    def _build(self, in_features: int) -> None:
        self.spec = self.spec.with_in_features(in_features)
        self._load(self._source.for_layer(self._index, self.spec))

    def _effective_kernel(self, cdt) -> np.ndarray:
        w = self.kernel.astype(cdt)
        return w * self.mask.astype(cdt) if self.mask is not None else w

    def forward(self, x) -> np.ndarray:
        """y = f(x @ (kernel * mask) + bias); x (*, in_features) -> y (*, units)."""
        x = as_input(x)
        if x.ndim == 0:
            raise SpecError(f"x must have at least 1 dimension (*, in_features). Received: x of shape {x.shape}")
        if not self.built:
            self._build(x.shape[-1])
        if x.shape[-1] != self.spec.in_features:
            raise SpecError(f"x must have last dimension in_features={self.spec.in_features}. "
                            f"Received: x of shape {x.shape}")
        dt, cdt = numpy_dtype(self.spec.dtype), compute_dtype(self.spec.dtype)
        xc = x.astype(dt).astype(cdt)  # the framework casts the input to the layer dtype first
        z = xc @ self._effective_kernel(cdt)
        if self.bias is not None:
            z = z + self.bias.astype(cdt)
        z = z.astype(dt).astype(cdt)
        y = self.spec.activation.forward(z).astype(dt)
        self._cache = (xc, z, y.astype(cdt))
        return y

    def backward(self, grad_out) -> np.ndarray:
        """Given dL/dy (*, units): store dL/dkernel, dL/dbias in ``grads``; return dL/dx (*, in)."""
        self._require_forward()
        xc, z, y = self._cache
        dt, cdt = numpy_dtype(self.spec.dtype), compute_dtype(self.spec.dtype)
        g = np.asarray(grad_out).astype(cdt)
        if g.shape != y.shape:
            raise SpecError(f"grad_out must have the output's shape {y.shape}. Received: grad_out of shape {g.shape}")
        dz = self.spec.activation.vjp(z, y, g).astype(dt).astype(cdt)
        w = self._effective_kernel(cdt)
        dx = dz @ w.T
        x2, dz2 = xc.reshape(-1, xc.shape[-1]), dz.reshape(-1, dz.shape[-1])
        dw = x2.T @ dz2
        if self.mask is not None:
            dw = dw * self.mask.astype(cdt)
        self._grads = {"kernel": dw.astype(dt)}
        if self.bias is not None:
            self._grads["bias"] = dz2.sum(axis=0).astype(dt)
        return dx.astype(dt)

    @property
    def grad_kernel(self):
        return self._grads.get("kernel")

    @property
    def grad_bias(self):
        return self._grads.get("bias")

    def params(self) -> dict[str, np.ndarray]:
        if not self.built:
            raise SpecError("this lazy DenseLayer has no parameters yet: run one input through it first")
        out = {"kernel": self.kernel}
        if self.bias is not None:
            out["bias"] = self.bias
        if self.mask is not None:
            out["mask"] = self.mask
        return out


class BilinearLayer(Layer):
    """Reference Bilinear: y_k = x1 @ kernel[k] @ x2 + bias[k].

    x1 (*, in1), x2 (*, in2) with equal leading dims -> y (*, units); kernel (units, in1, in2).
    """

    def __init__(self, spec: Bilinear, source: ParamSource, index: int = 0) -> None:
        self.spec = spec
        params = source.for_layer(index, spec)
        self.kernel = np.array(params["kernel"], copy=True)
        self.bias = np.array(params["bias"], copy=True) if "bias" in params else None
        self._cache = None
        self._grads = {}

    def forward(self, x1, x2) -> np.ndarray:
        x1, x2 = as_input(x1, "x1"), as_input(x2, "x2")
        s = self.spec
        if x1.shape[-1:] != (s.in1_features,) or x2.shape[-1:] != (s.in2_features,) or x1.shape[:-1] != x2.shape[:-1]:
            raise SpecError(f"inputs must be x1 (*, {s.in1_features}) and x2 (*, {s.in2_features}) with equal "
                            f"leading dimensions. Received: x1 of shape {x1.shape}, x2 of shape {x2.shape}")
        dt, cdt = numpy_dtype(s.dtype), compute_dtype(s.dtype)
        a, b = x1.astype(dt).astype(cdt), x2.astype(dt).astype(cdt)
        w = self.kernel.astype(cdt)
        y = np.einsum("...i,kij,...j->...k", a, w, b, optimize=True)
        if self.bias is not None:
            y = y + self.bias.astype(cdt)
        self._cache = (a, b)
        return y.astype(dt)

    def backward(self, grad_out) -> tuple[np.ndarray, np.ndarray]:
        """Given dL/dy (*, units): store grads; return (dL/dx1, dL/dx2)."""
        self._require_forward()
        a, b = self._cache
        dt, cdt = numpy_dtype(self.spec.dtype), compute_dtype(self.spec.dtype)
        g = np.asarray(grad_out).astype(cdt)
        w = self.kernel.astype(cdt)
        dx1 = np.einsum("...k,kij,...j->...i", g, w, b, optimize=True)
        dx2 = np.einsum("...k,kij,...i->...j", g, w, a, optimize=True)
        g2 = g.reshape(-1, g.shape[-1])
        self._grads = {"kernel": np.einsum("nk,ni,nj->kij", g2, a.reshape(-1, a.shape[-1]),
                                           b.reshape(-1, b.shape[-1]), optimize=True).astype(dt)}
        if self.bias is not None:
            self._grads["bias"] = g2.sum(axis=0).astype(dt)
        return dx1.astype(dt), dx2.astype(dt)

    def params(self) -> dict[str, np.ndarray]:
        out = {"kernel": self.kernel}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


class IdentityLayer(Layer):
    """y = x; for a Flatten spec, y = x.reshape(batch, -1) (every axis after the first)."""

    def __init__(self, spec: Identity | None = None) -> None:
        self.spec = spec or Identity()
        self._cache = None

    def forward(self, x):
        x = as_input(x)
        self._cache = x.shape
        if isinstance(self.spec, Flatten) and x.ndim > 2:
            return x.reshape(x.shape[0], -1)
        return x

    def backward(self, grad_out):
        self._require_forward()
        return np.asarray(grad_out).reshape(self._cache)

    def params(self) -> dict[str, np.ndarray]:
        return {}


class SequentialModel(Layer):
    """Reference Sequential: ``layers`` applied in order; backward runs them in reverse."""

    def __init__(self, spec: Sequential, source: ParamSource) -> None:
        self.spec = spec
        self.layers = [_compile_layer(layer, source, i) for i, layer in enumerate(spec.layers)]
        self._cache = None

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        self._cache = True
        return x

    def backward(self, grad_out):
        self._require_forward()
        g = grad_out
        for layer in reversed(self.layers):
            g = layer.backward(g)
        return g

    @property
    def grads(self) -> dict[str, np.ndarray]:
        return {f"{i}.{k}": v for i, layer in enumerate(self.layers) for k, v in layer.grads.items()}

    def params(self) -> dict[str, np.ndarray]:
        return {f"{i}.{k}": v for i, layer in enumerate(self.layers) for k, v in layer.params().items()}


_LAYER_TYPES = (DenseLayer, BilinearLayer, IdentityLayer, ActivationLayer, SequentialModel)


def _compile_layer(spec, source: ParamSource, index: int):
    if isinstance(spec, Dense):
        return DenseLayer(spec, source, index)
    if isinstance(spec, Bilinear):
        return BilinearLayer(spec, source, index)
    if isinstance(spec, Identity):
        return IdentityLayer(spec)
    if isinstance(spec, Activation):
        return ActivationLayer(spec)
    raise TypeError(f"spec must be a dense_bridge spec. {received('spec', spec)}")


def owns(obj) -> bool:
    return isinstance(obj, _LAYER_TYPES)


def compile(spec, source: ParamSource):
    """A reference layer or model for ``spec`` with parameters from ``source``."""
    if isinstance(spec, Sequential):
        return SequentialModel(spec, source)
    return _compile_layer(spec, source, 0)


def sublayers(native) -> list:
    """The layers of a reference model in order: its ``layers``, or ``[native]`` for a lone layer."""
    return native.layers if isinstance(native, SequentialModel) else [native]
