"""The pieces of a language-model run: its config, objective, eval sets, first weights, sample."""

from loomax.lm.config import SampleConfig, TrainLmConfig, resolve_vocab_size
from loomax.lm.eval_sets import eval_sets, source_name
from loomax.lm.loss import lm_loss, model_lm_loss
from loomax.lm.sample import sample_text
from loomax.lm.weights import (
    check_initial_weights,
    hf_source,
    hf_type_args,
    initial_model,
    initial_weights,
    with_hf_model,
)

__all__ = [
    "SampleConfig",
    "TrainLmConfig",
    "check_initial_weights",
    "hf_source",
    "hf_type_args",
    "eval_sets",
    "initial_model",
    "initial_weights",
    "lm_loss",
    "model_lm_loss",
    "resolve_vocab_size",
    "sample_text",
    "source_name",
    "with_hf_model",
]
