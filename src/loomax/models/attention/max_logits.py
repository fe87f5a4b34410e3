"""Each attention head's largest pre-softmax logit, reported out of the forward pass on request
(QK-clip, ``optimizer.qk_clip_tau``: ``loomax.optim.qk_clip``).

While a ``collecting()`` block is open (at trace time: the train step opens one around the
loss when QK-clip is on), ``causal_attention`` computes, beside its output, the maximum over
batch, queries and visible keys of each query head's scaled scores ``q . k * scale``, and
``report``s it (axis ``heads``). Outside one nothing is computed, so the ordinary step traces
exactly as before. A stack of blocks is scanned with a frame per layer
(``models/blocks/taps.py`` ``scan_layers``), which ``record``s the layers' maxima as one
``(layers, heads)`` array under the stack's name (``stack_key(first_layer)``); a model maps
those names to its attention modules (``qk_clip_attention``). Only the ``vanilla`` and
``blockwise`` backends compute the maxima; the others, context-parallel attention, soft-capped
scores and sinks are refused in one line (``refuse_reason``).
"""

from __future__ import annotations

import haliax as hax
import jax

from loomax.trace_frames import FrameStack

ATTN = "attn"
"""The key under which an attention reports within its frame."""

MAX_BACKENDS = ("vanilla", "blockwise")
"""The attention backends that compute per-head maximum logits."""

_FRAMES = FrameStack()


def active() -> bool:
    """Whether a ``collecting()`` block is open (attention reports its maximum logits)."""
    return _FRAMES.active()


def collecting():
    """Open a frame: reports inside it land in the dict yielded (``{name: maxima}``)."""
    return _FRAMES.open()


def record(name: str, maxima: hax.NamedArray) -> None:
    """Record ``maxima`` under ``name`` in the open frame (the elementwise maximum with what
    is there already), if one is open; stopped from the gradient."""
    frame = _FRAMES.innermost()
    if frame is None:
        return
    maxima = jax.lax.stop_gradient(maxima)
    frame[name] = maxima if name not in frame else hax.maximum(frame[name], maxima)


def report(maxima: hax.NamedArray) -> None:
    """An attention's per-head maxima (axis ``heads``) into the open frame."""
    record(ATTN, maxima)


def stack_key(first_layer: int) -> str:
    """The name a stack of blocks whose first block is model layer ``first_layer`` records
    its ``(layers, heads)`` maxima under."""
    return f"layers_from_{first_layer}"


def refuse_reason(backend: str, *, context: bool, softcap: bool, sinks: bool) -> str | None:
    """Why an attention cannot report its maximum logits, or None."""
    if context:
        return "context-parallel attention (trainer.mesh.context > 1)"
    if softcap or sinks:
        return "soft-capped scores or attention sinks"
    if backend not in MAX_BACKENDS:
        return f"model.attn_backend {backend!r} (use vanilla or blockwise)"
    return None
