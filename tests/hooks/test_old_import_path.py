"""The built-in hooks moved from ``loomax.callbacks`` to ``loomax.hooks``; the old path still
imports the same objects and modules."""

from __future__ import annotations


def test_old_import_path_gives_the_same_hooks():
    from loomax.callbacks.eval import EvalHook

    import loomax.callbacks
    import loomax.hooks
    from loomax.callbacks import EmaHook
    from loomax.hooks import ema, eval

    assert EmaHook is ema.EmaHook and EvalHook is eval.EvalHook
    assert set(loomax.callbacks.__all__) == set(loomax.hooks.__all__)
