"""Shared building blocks of the families.

The model bodies: ``decoder`` (the Llama-style decoder every rotary family builds on) and
``gpt2_model`` (GPT-2's); and the pieces: ``norms``, ``mlp_activations``, ``dropout``,
``fp8`` (FP8 linear layers), ``remat`` and ``offload`` (what a layer keeps, where its
parameters rest), ``taps`` and ``logits_stats`` (activation statistics inside the step),
``buffers`` (non-trainable arrays the step updates). Import the modules themselves; this
package's ``__init__`` imports nothing.
"""
