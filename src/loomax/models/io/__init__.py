"""A model on disk.

``saving`` (``model.save(dir)`` and ``load_model(dir)``), ``files`` (the two files of a saved
model) and ``hf_layout`` (name-by-name tables between Loomax parameters and Hugging Face
tensors). Import the modules themselves; this package's ``__init__`` imports nothing.
"""
