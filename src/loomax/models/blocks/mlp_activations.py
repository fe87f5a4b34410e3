"""The MLP's nonlinearity, chosen by name (``model.activation_function``).

Names are those of transformers' ``ACT2FN``, so a config.json's ``activation_function``
(GPT-2) or ``hidden_act`` (Llama) names the same function here and there.
"""

from __future__ import annotations

from collections.abc import Callable

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from loomax.config import ConfigError


def _relu_squared(x: NamedArray) -> NamedArray:
    return hax.square(hnn.relu(x))


def _quick_gelu(x: NamedArray) -> NamedArray:
    return x * hnn.sigmoid(1.702 * x)


ACTIVATION_FUNCTIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "gelu": lambda x: hnn.gelu(x, approximate=False),
    "gelu_new": lambda x: hnn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: hnn.gelu(x, approximate=True),
    "gelu_fast": lambda x: hnn.gelu(x, approximate=True),
    "quick_gelu": _quick_gelu,
    "relu": hnn.relu,
    "relu2": _relu_squared,
    "silu": hnn.silu,
    "swish": hnn.silu,
    "tanh": hax.tanh,
    "sigmoid": hnn.sigmoid,
}
"""transformers' name -> the function (``gelu_new``, ``gelu_pytorch_tanh`` and ``gelu_fast`` are
all GELU's tanh approximation; ``relu2`` is squared ReLU; ``swish`` is ``silu``)."""


def check_activation(name: str) -> None:
    """Raise ``ConfigError`` naming ``model.activation_function`` for an unknown name."""
    if name not in ACTIVATION_FUNCTIONS:
        raise ConfigError(
            f"model.activation_function must be one of {sorted(ACTIVATION_FUNCTIONS)}, got {name!r}"
        )


def activation(name: str) -> Callable[[NamedArray], NamedArray]:
    """The function called ``name`` (checked by ``check_activation``)."""
    check_activation(name)
    return ACTIVATION_FUNCTIONS[name]


def gated_unit(
    name: str, limit: float | None = None, alpha: float = 1.702
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated unit ``glu(gate, up)`` on plain arrays: ``act(gate) * up`` with the function
    called ``name``, or with a ``limit`` gpt-oss's clamped SwiGLU: the gate clamped to at most
    ``limit``, the up projection to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha *
    gate)`` (``name`` unused there)."""
    if limit is not None:

        def clamped(g: jax.Array, u: jax.Array) -> jax.Array:
            g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
            return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

        return clamped
    act = activation(name)
    return lambda g, u: act(hax.named(g, tuple(f"d{i}" for i in range(g.ndim)))).array * u
