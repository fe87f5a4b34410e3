"""The weight-name tables now live beside the models (``loomax.models.io.hf_layout``); kept for
imports of the old path."""

from loomax.models.io.hf_layout import Dims, Param, export_tensors, load_tensors

__all__ = ["Dims", "Param", "export_tensors", "load_tensors"]
