"""Decoding with a KV cache.

``generate`` (prefill, then one step per token: the sampler), ``rolling_cache`` (the
window-sized cache for sliding-window models) and ``split_prefill`` (a prompt's prefill split
over the ``context`` mesh axis). The models' own ``decode`` steps live with their blocks.
Import the modules themselves; this package's ``__init__`` imports nothing.
"""
