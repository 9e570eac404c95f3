"""Backend-neutral layer specs: Dense, Bilinear, Identity and Sequential.

A spec says what a layer computes, not how a framework stores it. Specs are immutable,
compare by value, and round-trip through JSON (``to_config`` / :func:`from_config`).
Parameters are described in the canonical layout:

- Dense: ``kernel`` (in_features, units), ``bias`` (units,), ``mask`` (in_features, units).
  y = activation(x @ (kernel * mask) + bias), for x of shape (*, in_features).
- Bilinear: ``kernel`` (units, in1_features, in2_features), ``bias`` (units,).
  y_k = x1 @ kernel[k] @ x2 + bias[k], for x1 (*, in1) and x2 (*, in2).
"""
from __future__ import annotations

from typing import Any

from . import activations as _activations
from . import initializers as _initializers
from ._dtypes import canonical_dtype
from ._errors import SpecError, check_positive_int, check_type, received
from .activations import Activation
from .wiring import Wiring

__all__ = ["Spec", "Dense", "Bilinear", "Identity", "Flatten", "Sequential", "Activation", "from_config"]

class Spec:
    """Base of every layer spec: immutability, value equality and the config envelope."""

    __slots__ = ()
    #: Input width; None while a lazy layer waits for its first input (overridden per spec).
    in_features: int | None = None

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} specs are immutable; use .replace(...)")

    def __reduce__(self):
        # immutable objects cannot be restored attribute by attribute: rebuild from the config
        # (copy.deepcopy and pickle/torch.save of compiled models carry the spec hint)
        return (from_config, (self.to_config(),))

    def _set(self, **fields: Any) -> None:
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    def _fields(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def _config_body(self) -> dict:
        return self._fields()

    def to_config(self) -> dict:
        """A JSON-able dict: ``{"class_name": ..., "config": {...}}``; rebuild with db.from_config."""
        return {"class_name": type(self).__name__, "config": self._config_body()}

    def replace(self, **changes: Any) -> "Spec":
        """A copy with some constructor arguments changed (validated again)."""
        fields = self._fields()
        fields.update(changes)
        return type(self)(**fields)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted((k, _hashable(v)) for k, v in self._fields().items()))))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._fields().items() if v is not None)
        return f"{type(self).__name__}({shown})"

    # ------------------------------------------------------------------ shapes
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter names -> shapes. Raises SpecError while in_features is unknown."""
        return {}

    @property
    def num_params(self) -> int:
        """Number of stored parameter values (a mask's zeros included; the mask itself excluded)."""
        return sum(_prod(s) for k, s in self.param_shapes().items() if not k.endswith("mask"))

    def output_features(self, in_features: int | None) -> int | None:
        """Width of the output for an input of width ``in_features`` (None when unknown)."""
        return in_features

    def flops(self, batch_size: int = 1) -> int:  # pragma: no cover - overridden
        raise NotImplementedError


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _check_name(name: object) -> str | None:
    if name is not None:
        check_type("name", name, str, "a string or None")
    return name


def _check_batch(batch_size: object) -> int:
    return check_positive_int("batch_size", batch_size)


def _lazy_error(spec: Spec) -> SpecError:
    return SpecError(
        f"{type(spec).__name__}(units={getattr(spec, 'units', '?')}) has in_features=None (lazy): its "
        "parameter shapes are fixed by the first input. Pass in_features=... or run one input first."
    )


# ---------------------------------------------------------------------- Dense
class Dense(Spec):
    """A fully connected layer: y = activation(x @ (kernel * mask) + bias).

    Shapes: x (*, in_features) -> y (*, units); kernel (in_features, units); bias (units,);
    mask (in_features, units), 0/1, never trained. ``in_features=None`` is lazy.
    """

    __slots__ = ("units", "in_features", "use_bias", "activation", "kernel_init", "bias_init",
                 "mask", "dtype", "name")

    def __init__(self, units: int, *, in_features: int | None = None, use_bias: bool = True,
                 activation: Any = None, kernel_init: Any = "glorot_uniform", bias_init: Any = "zeros",
                 mask: Any = None, dtype: Any = "float32", name: str | None = None) -> None:
        units = check_positive_int("units", units)
        if in_features is not None:
            in_features = check_positive_int("in_features", in_features)
        check_type("use_bias", use_bias, bool, "True or False")
        wiring = None
        if mask is not None:
            wiring = mask if isinstance(mask, Wiring) else Wiring(mask, allow_empty_outputs=True)
            m_in, m_units = wiring.shape
            if m_units != units or (in_features is not None and m_in != in_features):
                raise SpecError(
                    f"mask must have shape (in_features, units) = ({in_features if in_features else m_in}, "
                    f"{units}). Received: mask of shape {wiring.shape}"
                )
            in_features = m_in
        self._set(
            units=units, in_features=in_features, use_bias=use_bias,
            activation=_activations.get(activation),
            kernel_init=_initializers.get(kernel_init, "kernel_init"),
            bias_init=_initializers.get(bias_init, "bias_init"),
            mask=wiring, dtype=canonical_dtype(dtype), name=_check_name(name),
        )

    def _fields(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def _config_body(self) -> dict:
        f = self._fields()
        f["activation"] = self.activation.to_config()
        f["kernel_init"] = self.kernel_init.to_config()
        f["bias_init"] = self.bias_init.to_config()
        f["mask"] = None if self.mask is None else self.mask.to_config()
        return f

    @classmethod
    def _from_body(cls, body: dict) -> "Dense":
        body = dict(body)
        body["activation"] = _activations.get(body.get("activation"))
        body["kernel_init"] = _initializers.get(body.get("kernel_init", "glorot_uniform"))
        body["bias_init"] = _initializers.get(body.get("bias_init", "zeros"))
        if body.get("mask") is not None:
            body["mask"] = Wiring.from_config(body["mask"])
        return cls(**body)

    @property
    def lazy(self) -> bool:
        return self.in_features is None

    def with_in_features(self, in_features: int) -> "Dense":
        """This spec with its input width fixed (the same spec when it already is)."""
        if self.in_features == in_features:
            return self
        if self.in_features is not None:
            raise SpecError(f"Dense(units={self.units}) expects in_features={self.in_features}. "
                            f"{received('in_features', in_features)}")
        return self.replace(in_features=in_features)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.in_features is None:
            raise _lazy_error(self)
        shapes = {"kernel": (self.in_features, self.units)}
        if self.use_bias:
            shapes["bias"] = (self.units,)
        if self.mask is not None:
            shapes["mask"] = (self.in_features, self.units)
        return shapes

    def output_features(self, in_features: int | None) -> int:
        return self.units

    def flops(self, batch_size: int = 1) -> int:
        """Multiply-adds counted as 2 FLOPs; a mask does not reduce them (the matmul stays dense)."""
        b = _check_batch(batch_size)
        if self.in_features is None:
            raise _lazy_error(self)
        total = 2 * b * self.in_features * self.units
        if self.use_bias:
            total += b * self.units
        return total + self.activation.flops(b, self.units)


# ------------------------------------------------------------------- Bilinear
class Bilinear(Spec):
    """y_k = x1 @ kernel[k] @ x2 + bias[k] for x1 (*, in1_features), x2 (*, in2_features).

    kernel (units, in1_features, in2_features), like torch.nn.Bilinear's weight; bias (units,).
    ``init`` draws the kernel with fan_in = in1_features (torch's bound 1/sqrt(in1)); the bias
    uses the same distribution for "torch_default"/"mlx_default" and zeros otherwise.
    """

    __slots__ = ("in1_features", "in2_features", "units", "use_bias", "init", "dtype", "name")

    def __init__(self, in1_features: int, in2_features: int, units: int, *, use_bias: bool = True,
                 init: Any = "torch_default", dtype: Any = "float32", name: str | None = None) -> None:
        check_type("use_bias", use_bias, bool, "True or False")
        self._set(
            in1_features=check_positive_int("in1_features", in1_features),
            in2_features=check_positive_int("in2_features", in2_features),
            units=check_positive_int("units", units), use_bias=use_bias,
            init=_initializers.get(init, "init"), dtype=canonical_dtype(dtype), name=_check_name(name),
        )

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.in1_features

    def _fields(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def _config_body(self) -> dict:
        f = self._fields()
        f["init"] = self.init.to_config()
        return f

    @classmethod
    def _from_body(cls, body: dict) -> "Bilinear":
        body = dict(body)
        body["init"] = _initializers.get(body.get("init", "torch_default"), "init")
        return cls(**body)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"kernel": (self.units, self.in1_features, self.in2_features)}
        if self.use_bias:
            shapes["bias"] = (self.units,)
        return shapes

    def output_features(self, in_features: int | None) -> int:
        return self.units

    def flops(self, batch_size: int = 1) -> int:
        b = _check_batch(batch_size)
        # x1 @ A_k: 2*in1*in2 per output, then the dot with x2: 2*in2, plus the bias.
        return b * self.units * (2 * self.in1_features * self.in2_features + 2 * self.in2_features
                                 + (1 if self.use_bias else 0))


# ------------------------------------------------------------------- Identity
class Identity(Spec):
    """y = x. No parameters; usable anywhere in a Sequential."""

    __slots__ = ("name",)

    def __init__(self, *, name: str | None = None) -> None:
        self._set(name=_check_name(name))

    def _fields(self) -> dict:
        return {"name": self.name}

    def flops(self, batch_size: int = 1) -> int:
        _check_batch(batch_size)
        return 0


class Flatten(Identity):
    """Flattens every axis after the first: (batch, d1, ..., dn) -> (batch, d1*...*dn), as torch's
    ``nn.Flatten()``, ``torch.flatten(x, 1)`` and Keras' ``layers.Flatten`` do. No parameters.

    On (batch, features) inputs it is the identity, which is how a Sequential counts widths
    through it (its ``in_features`` is the width after flattening, e.g. 784 for 28x28 images)
    and how equivalence tests see it; it subclasses :class:`Identity` for that reason only.
    """

    __slots__ = ()


# ----------------------------------------------------------------- Sequential
class Sequential(Spec):
    """A stack of layers applied in order (an MLP).

    ``layers`` is a tuple of Dense, Identity and Activation specs, each Dense with its
    ``in_features`` filled in from the layer before it. Only the first Dense may stay lazy.
    Parameters are keyed by position: "0.kernel", "0.bias", "2.kernel", ...
    """

    __slots__ = ("layers", "in_features", "name")

    def __init__(self, layers: Any, *, in_features: int | None = None, name: str | None = None) -> None:
        if isinstance(layers, (Spec, Activation, str)) or not hasattr(layers, "__iter__"):
            raise TypeError(f"layers must be a list of layer specs. {received('layers', layers)}")
        layers = list(layers)
        if in_features is not None:
            in_features = check_positive_int("in_features", in_features)
        width = in_features
        filled: list = []
        for i, layer in enumerate(layers):
            if isinstance(layer, Sequential):
                raise SpecError(f"layers[{i}] is a Sequential; nest by listing its layers instead "
                                f"(parameter keys are positions). {received(f'layers[{i}]', layer)}")
            if isinstance(layer, Bilinear):
                raise SpecError(f"layers[{i}] is a Bilinear, which takes two inputs and cannot sit in a "
                                f"Sequential chain. {received(f'layers[{i}]', layer)}")
            if not isinstance(layer, (Dense, Identity, Activation)):
                raise TypeError(f"layers[{i}] must be a Dense, Identity or Activation spec, got "
                                f"{type(layer).__name__}. {received(f'layers[{i}]', layer)}")
            if isinstance(layer, Dense):
                if width is not None and layer.in_features is not None and layer.in_features != width:
                    source = f"layers[{_previous_dense(filled)}] produces {width} features" if filled and \
                        _previous_dense(filled) is not None else f"in_features={width}"
                    raise SpecError(f"layers[{i}] expects in_features={layer.in_features} but {source}. "
                                    f"{received(f'layers[{i}].in_features', layer.in_features)}")
                if width is not None:
                    layer = layer.with_in_features(width)
                if in_features is None and not any(isinstance(f, Dense) for f in filled):
                    in_features = layer.in_features
                width = layer.units
            filled.append(layer)
        dtypes = {l.dtype for l in filled if isinstance(l, Dense)}
        if len(dtypes) > 1:
            # frameworks disagree on mixed chains (torch raises, Keras and MLX cast silently):
            # one dtype per Sequential keeps every backend computing the same thing
            found = ", ".join(f"layers[{i}]={l.dtype}" for i, l in enumerate(filled) if isinstance(l, Dense))
            raise SpecError(f"all Dense layers of a Sequential must share one dtype. Received: {found}")
        self._set(layers=tuple(filled), in_features=in_features, name=_check_name(name))

    def _fields(self) -> dict:
        return {"layers": self.layers, "in_features": self.in_features, "name": self.name}

    def _config_body(self) -> dict:
        return {"layers": [layer_config(l) for l in self.layers], "in_features": self.in_features,
                "name": self.name}

    @classmethod
    def _from_body(cls, body: dict) -> "Sequential":
        return cls([from_config(c) for c in body["layers"]], in_features=body.get("in_features"),
                   name=body.get("name"))

    @property
    def lazy(self) -> bool:
        return self.in_features is None and any(isinstance(l, Dense) for l in self.layers)

    @property
    def dtype(self) -> str:
        """The dtype of the first layer with parameters ("float32" when there is none)."""
        return next((l.dtype for l in self.layers if isinstance(l, Dense)), "float32")

    def with_in_features(self, in_features: int) -> "Sequential":
        if self.in_features == in_features:
            return self
        return Sequential(self.layers, in_features=in_features, name=self.name)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for i, layer in enumerate(self.layers):
            for key, shape in layer_param_shapes(layer).items():
                shapes[f"{i}.{key}"] = shape
        return shapes

    def output_features(self, in_features: int | None) -> int | None:
        width = in_features if in_features is not None else self.in_features
        for layer in self.layers:
            width = layer_output_features(layer, width)
        return width

    def flops(self, batch_size: int = 1) -> int:
        b = _check_batch(batch_size)
        total, width = 0, self.in_features
        for layer in self.layers:
            if isinstance(layer, Activation):
                total += layer.flops(b, width)
            else:
                total += layer.flops(b)
            width = layer_output_features(layer, width)
        return total


def _previous_dense(filled: list) -> int | None:
    for j in range(len(filled) - 1, -1, -1):
        if isinstance(filled[j], Dense):
            return j
    return None


# --------------------------------------------- helpers that also accept Activation
def layer_param_shapes(layer) -> dict[str, tuple[int, ...]]:
    """param_shapes() for any layer spec, Activation (no parameters) included."""
    return {} if isinstance(layer, Activation) else layer.param_shapes()


def layer_output_features(layer, in_features: int | None) -> int | None:
    """Output width of any layer spec, Activation included."""
    return in_features if isinstance(layer, Activation) else layer.output_features(in_features)


def layer_config(layer) -> dict:
    """to_config() for any layer spec, wrapping an Activation in the class envelope."""
    if isinstance(layer, Activation):
        return {"class_name": "Activation", "config": layer.to_config()}
    return layer.to_config()


def param_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Canonical parameter names -> shapes for any spec (an Activation has none)."""
    return layer_param_shapes(spec)


_CLASSES = {"Dense": Dense, "Bilinear": Bilinear, "Sequential": Sequential}


def from_config(config: Any):
    """Rebuild a spec from ``spec.to_config()`` (a dict, or its JSON string)."""
    if isinstance(config, str):
        import json

        try:
            config = json.loads(config)
        except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and huge ints
            raise SpecError(f"config is not valid JSON ({type(exc).__name__}: {str(exc)[:200]}). "
                            f"{received('config', config)}") from None
    if isinstance(config, dict) and "class_name" not in config and "name" in config:
        return Activation.from_config(config)  # Activation.to_config() has no class envelope
    if not isinstance(config, dict) or "class_name" not in config:
        raise TypeError(f"config must be a dict made by spec.to_config(). {received('config', config)}")
    name, body = config["class_name"], config.get("config", {})
    if not isinstance(name, str):
        raise SpecError(f"config's class_name must be a string. {received('class_name', name)}")
    if name not in _CLASSES and name not in ("Activation", "Identity", "Flatten"):
        raise SpecError(f"config has an unknown class_name. {received('class_name', name)}")
    if not isinstance(body, dict):
        raise SpecError(f"config['config'] of {name} must be a dict. {received('config', body)}")
    try:
        if name == "Activation":
            return Activation.from_config(body)
        if name == "Identity":
            return Identity(**body)
        if name == "Flatten":
            return Flatten(**body)
        return _CLASSES[name]._from_body(body)
    except SpecError as exc:
        raise SpecError(f"config for {name}: {exc}") from None
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, RecursionError) as exc:
        raise SpecError(f"config for {name} is malformed ({type(exc).__name__}: {exc}). "
                        f"{received('config', config)}") from None
