"""What draccus reads of a class, read once per class (`loomax.config_parse_cache`)."""

from __future__ import annotations

import argparse
import inspect
import types
import typing

from draccus.wrappers import dataclass_wrapper, field_wrapper

from loomax import config_parse_cache
from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig


def test_a_parse_reads_each_action_signature_once_at_most(monkeypatch):
    """A whole run config's ~8,000 flags ask for a handful of action classes' signatures:
    each is read once (draccus alone reads one per flag)."""
    reads = []

    def counted(cls):
        reads.append(cls)
        return inspect.getfullargspec(cls)

    monkeypatch.setattr(
        config_parse_cache, "inspect", types.SimpleNamespace(getfullargspec=counted)
    )
    config_parse_cache.cached_argspec.cache_clear()
    config = parse_config(TrainLmConfig, None, ["--model.num_layers", "3"])
    assert config.model.num_layers == 3
    assert 0 < len(reads) == len(set(reads)) <= 10, reads


def test_the_kept_options_are_the_actions_own():
    """The cached signature keeps what draccus's uncached one keeps."""
    assert field_wrapper.inspect.getfullargspec is config_parse_cache.cached_argspec
    options = {"dest": "x", "default": 1, "type": int, "help": "h", "nargs": None, "bogus": 0}
    kept = field_wrapper.only_keep_action_args(dict(options), "store_true")
    spec = inspect.getfullargspec(argparse._StoreTrueAction)
    assert set(kept) == {k for k in options if k in spec.args}


def test_a_second_parse_resolves_no_type_hints_again(monkeypatch):
    """Each section's type hints are resolved once: a second parse of the same config reads
    them all from the cache (draccus alone resolves ~140 a parse), and parses the same."""
    first = parse_config(TrainLmConfig, None, ["--model.num_layers", "3"])
    resolved = []

    def counted(cls):
        resolved.append(cls)
        return typing.get_type_hints(cls)

    monkeypatch.setattr(config_parse_cache, "typing", types.SimpleNamespace(get_type_hints=counted))
    assert dataclass_wrapper.typing.get_type_hints is config_parse_cache.cached_type_hints
    assert parse_config(TrainLmConfig, None, ["--model.num_layers", "3"]) == first
    assert resolved == []
    config_parse_cache.cached_type_hints.cache_clear()
    assert parse_config(TrainLmConfig, None, ["--model.num_layers", "3"]) == first
    assert 0 < len(resolved) == len(set(resolved)), resolved
