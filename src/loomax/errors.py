"""Exceptions the command line reports in one line: bad input from the user, not bugs.

This module sits at the bottom of the stack (it imports nothing from loomax), so every
layer can raise these. ``loomax.cli.main`` catches ``UserError`` around every subcommand,
prints ``loomax <command>: error: <message>`` on one line and exits with code 2; a
``TrainingFailure`` (the loss went NaN, the run diverged) is one line too, with exit code
1; any other exception is a bug and keeps its traceback.

A plain ``ValueError`` is not bad input: code that finds a mistake of the user raises one
of these classes (or ``loomax.config.ConfigError`` for a config value), naming what was
wrong and where.
"""

from __future__ import annotations

__all__ = [
    "BadFileError",
    "DataSourceError",
    "MissingFileError",
    "MissingPackageError",
    "TrainingFailure",
    "UserError",
]


class UserError(Exception):
    """Bad input from the user: config, files, missing optional packages.

    The CLI prints it in one line and exits 2. Subclasses may also derive from a builtin
    (``ValueError``, ``ImportError``, ...) so that existing ``except`` clauses still match.
    """


class MissingPackageError(UserError, ImportError):
    """An optional package that the chosen feature needs is not installed; the message says what to install."""


class DataSourceError(UserError, ValueError):
    """A bad data record or an unreadable data file; the message names the file (and line)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named (a checkpoint, a model, a tokenizer) is not there;
    the message names it and the flag or key that named it."""


class BadFileError(UserError, ValueError):
    """A file the user named is there but cannot be used (another model's weights, a
    Hugging Face config this model cannot read); the message names the file."""


class TrainingFailure(Exception):
    """The run stopped for a reason in the training itself (a NaN loss, divergence): neither
    bad input nor a bug. The CLI prints it in one line and exits 1."""
