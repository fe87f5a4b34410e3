"""Exceptions the command line reports in one line: bad input from the user, not bugs.

This module sits at the bottom of the stack (it imports nothing from loomax), so every
layer can raise these. ``loomax.cli.main`` catches ``UserError`` around every subcommand,
prints ``loomax <command>: error: <message>`` on one line and exits with code 2; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["DataSourceError", "MissingPackageError", "UserError"]


class UserError(Exception):
    """Bad input from the user: config, files, missing optional packages.

    The CLI prints it in one line and exits 2. Subclasses may also derive from a builtin
    (``ValueError``, ``ImportError``, ...) so that existing ``except`` clauses still match.
    """


class MissingPackageError(UserError, ImportError):
    """An optional package that the chosen feature needs is not installed; the message says what to install."""


class DataSourceError(UserError, ValueError):
    """A bad data record or an unreadable data file; the message names the file (and line)."""
