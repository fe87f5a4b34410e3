"""Decoding with a KV cache.

``generate`` (prefill, then one step per token: the sampler), ``stack`` (the one decode
loop every family runs: its blocks over the KV cache), ``rolling_cache`` (the window-sized
cache for sliding-window models), ``kind_cache`` (a cache per kind of layer where the
windows differ: rolling for the windowed layers, full for the global ones) and ``split_prefill`` (a prompt's prefill split over the
``context`` mesh axis). A block's own ``decode`` (one layer's step) lives with the block.
Import the modules themselves; this package's ``__init__`` imports nothing.
"""
