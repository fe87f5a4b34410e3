"""Attention: every backend and what it needs.

``attention`` (``causal_attention``, ``model_attention``, ``cached_attention``: the backend
chosen by ``model.attn_backend``), ``flash`` (blockwise, pure JAX), ``splash`` and
``splash_pair`` (TPU Pallas kernels), ``cudnn_packed`` (cuDNN's packed-sequence kernel),
``causal_diagonal`` (the visible block pairs in a fixed schedule); context parallelism:
``ring_attention``, ``ring_hops``, ``ring_splash`` and ``sequence_layout`` (the zig-zag
layout); ``rotary`` (RoPE and ``RotaryConfig``). Import the modules themselves; this
package's ``__init__`` imports nothing.
"""
