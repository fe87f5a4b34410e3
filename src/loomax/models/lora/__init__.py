"""Low-rank adapters (LoRA) on a model's linear layers (``model.lora``).

``config`` (``LoraConfig``: targets, rank, alpha, dropout, and the freeze pattern that
trains the adapters alone), ``linear`` (``LoraLinear``: a ``haliax.nn.Linear`` with its
adapter; adding, merging and taking out adapters), ``experts`` (adapters on a mixture of
experts' stacked expert weights), ``dora`` (DoRA's magnitude and norms), ``files``
(adapters saved and loaded alone). The PEFT export is ``loomax.hf.peft``. Import the
modules themselves; this package's ``__init__`` imports nothing.
"""
