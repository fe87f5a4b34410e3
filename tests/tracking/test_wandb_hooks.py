"""W&B alerts (notify) and cancelling by tag (wandb_cancel) in a real run with wandb offline.

What offline wandb cannot show: that the W&B server turns the alert records into emails or
Slack messages, and the tags a user adds in the W&B UI (read through wandb's public API,
which needs the server). The cancel test reads the tags of the local wandb run object
instead (``read_tags``), the one part swapped.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from loomax.hooks import NotifyHook, WandbCancelHook
from loomax.tracking import WandbTrackerConfig

from .conftest import offline_runs, read_wandb_run, wandb_records


def test_alerts_and_a_cancel_tag_stop_the_run(tiny, tmp_path, wandb_offline, caplog):
    trainer = tiny.trainer(
        tmp_path,
        steps=10_000,
        tracker=WandbTrackerConfig(project="p"),
        max_train_time=timedelta(seconds=60),  # a safety net: the tag must stop it long before
    )
    run = trainer.tracker.run  # the wandb run starts with the tracker, before training
    trainer.add_hook(NotifyHook(wandb_alert=True, run_name="r1", num_train_steps=10_000))
    cancel = WandbCancelHook(check_seconds=0.05, read_tags=lambda r: list(r.tags))
    trainer.add_hook(cancel)
    server_side = WandbCancelHook()  # reads the W&B server: impossible offline, says so

    trainer.add_hook(server_side)

    @trainer.add_hook(every=3)
    def tag_the_run(info):
        if info.step == 3:
            run.tags = (*run.tags, "cancel")

    with caplog.at_level(logging.WARNING):
        final = trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    assert 3 < final.step < 10_000
    assert trainer.stop_reason == "the wandb run was tagged 'cancel' (requested by WandbCancelHook)"
    assert cancel.found == "cancel" and not server_side.watching
    assert "the wandb run is offline, so its tags cannot be read" in caplog.text

    (run_files,) = offline_runs(wandb_offline)
    read_wandb_run(run_files)  # waits for the run's exit record
    (path,) = run_files.glob("run-*.wandb")
    alerts = [r.alert for r in wandb_records(path) if r.WhichOneof("record_type") == "alert"]
    assert [(a.title, a.level) for a in alerts] == [("r1: start", "INFO"), ("r1: end", "INFO")]
    assert alerts[0].text == "r1 started at step 0 of 10000"
    assert alerts[1].text == (
        f"r1 stopped at step {final.step} of 10000: the wandb run was tagged 'cancel' "
        "(requested by WandbCancelHook)"
    )
