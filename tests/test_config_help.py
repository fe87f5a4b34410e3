"""Config fields' help text (`loomax.config_help`): draccus's own, found in one pass per class."""

from __future__ import annotations

import dataclasses

from draccus.wrappers import docstring as draccus_docstring

from loomax import config_help
from loomax.config import parse_config
from loomax.lm.config import TrainLmConfig


def _outcome(lookup, cls, name):
    try:
        return lookup(cls, name)
    except Exception as e:  # the same error counts as the same outcome
        return type(e)


def test_every_flag_of_a_run_config_gets_draccus_own_help_text(monkeypatch):
    seen = []

    def both(cls, name):
        mine = _outcome(config_help.attribute_docstring, cls, name)
        theirs = _outcome(config_help.ORIGINAL, cls, name)
        assert mine == theirs, (cls, name)
        seen.append(mine)
        return theirs

    monkeypatch.setattr(draccus_docstring, "get_attribute_docstring", both)
    parse_config(TrainLmConfig, None, [])
    assert len(seen) > 800  # every flag of every section and registered choice
    found = [d for d in seen if isinstance(d, draccus_docstring.AttributeDocString)]
    assert sum(bool(d.docstring_below) for d in found) > 700  # the fields' doc lines


def test_a_loomax_config_parse_uses_the_one_pass_lookup():
    assert draccus_docstring.get_attribute_docstring is config_help.attribute_docstring


def test_a_field_inherited_from_a_base_class_is_found_there():
    @dataclasses.dataclass
    class Base:
        width: int = 3
        """How wide."""

    @dataclasses.dataclass
    class Child(Base):
        depth: int = 2  # how deep

    assert config_help.attribute_docstring(Child, "width").docstring_below == "How wide."
    assert config_help.attribute_docstring(Child, "depth").comment_inline == "how deep"
