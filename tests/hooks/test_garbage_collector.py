"""Garbage collector hook: automatic GC is off during training, collected on the cadence, restored after."""

from __future__ import annotations

import gc

from loomax.hooks import GarbageCollectorHook


def test_gc_disabled_during_training_and_restored(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=4)
    hook = GarbageCollectorHook(every=2)
    enabled = []
    trainer.add_hook(hook)
    trainer.add_hook(lambda info: enabled.append(gc.isenabled()))
    assert gc.isenabled()
    trainer.train(tiny.init(trainer), tiny.batches())
    assert enabled == [False] * 4 and hook.collections == 2
    assert gc.isenabled()
