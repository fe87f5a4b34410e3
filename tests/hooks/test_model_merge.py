"""Model merge: the saved merged model is the average of the last `window` steps' weights."""

from __future__ import annotations

import numpy as np

from loomax.hooks import ModelMergeHook


def test_merged_model_is_the_window_average(tiny, tmp_path):
    trainer = tiny.trainer(tmp_path, steps=5)
    hook = ModelMergeHook(steps=[4], window=2, directory=str(tmp_path / "merged"))
    trainer.add_hook(hook)
    seen = {}
    trainer.add_hook(
        lambda info: seen.update(
            {info.step: np.asarray(info.state.model.token_embeddings.weight.array)}
        )
    )
    trainer.train(tiny.init(trainer), tiny.batches())
    assert hook.saved == [4]
    expected = (seen[3] + seen[4]) / 2

    fresh = tiny.trainer(tmp_path / "b", steps=5, initialize_from=str(tmp_path / "merged"))
    merged = np.asarray(tiny.init(fresh).model.token_embeddings.weight.array)
    np.testing.assert_allclose(merged, expected, rtol=1e-6)
