"""The mixture of experts.

``moe`` (the ``MoeMlp`` layer and ``MoeConfig``), ``moe_routing`` (top-k routing, balance
losses, ``RouterAux``), ``grouped_matmul`` (per-platform grouped matmuls), ``expert_ffn`` (the
experts' gated MLP over the receive buffer) and ``expert_parallel`` (experts split over the
``expert`` mesh axis). Import the modules themselves; this package's ``__init__`` imports
nothing.
"""
