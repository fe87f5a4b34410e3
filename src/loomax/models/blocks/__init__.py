"""Shared building blocks of the families.

The model bodies: ``decoder`` (the Llama-style decoder every rotary family builds on) and
``gpt2_model`` (GPT-2's); and the pieces: ``norms``, ``mlp_activations``, ``dropout``,
``fp8`` (FP8 linear layers), ``remat`` and ``offload`` (what a layer keeps, where its
parameters rest), ``taps`` and ``logits_stats`` (activation statistics inside the step),
``buffers`` (non-trainable arrays the step updates), ``pipeline`` (the layer stack staged
over the ``stage`` mesh axis); the newer blocks ``gated_delta``, ``gated_deltanet``,
``qwen3_next_model``, ``mla_block`` and ``mtp``. Import the modules themselves; this
package's ``__init__`` imports nothing.
"""
