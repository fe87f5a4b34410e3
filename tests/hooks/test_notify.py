"""Notify hook: real runs post to a real HTTP server on 127.0.0.1; a failed post only warns;
the URL never reaches the logs nor a saved config."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loomax.config import ConfigError, flatten_config, parse_config, to_yaml
from loomax.distributed.net import free_port
from loomax.hooks import DivergenceDetector, NotifyHook
from loomax.hooks.divergence import DivergenceError
from loomax.lm import TrainLmConfig
from loomax.train import StepInfo

SECRET_PATH = "/services/T0/B0/s3cr3tKEY"


class Receiver:
    """An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it; it answers 500
    to the bodies whose ``event`` is in ``fail``."""

    def __init__(self, fail=()):
        self.received: list[dict] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.received.append(body)
                receiver.paths.append(self.path)
                code = 500 if body.get("event") in fail else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format, *args):  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{SECRET_PATH}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver(fail={"metrics"})
    yield r
    r.close()


def test_a_diverging_run_posts_start_metrics_divergence_and_end(
    tiny, tmp_path, receiver, monkeypatch, caplog
):
    monkeypatch.setenv("LOOMAX_NOTIFY_URL", receiver.url)  # the URL from the environment
    trainer = tiny.trainer(tmp_path, steps=30, loss_fn=tiny.spiking_loss())
    trainer.add_hook(DivergenceDetector(ema=0.5, rel_threshold=0.5, patience=2, warmup=2))
    notify = NotifyHook(
        every=2, metrics=["train/l*"], format="json", run_name="r1", num_train_steps=30
    )
    trainer.add_hook(notify)
    with caplog.at_level(logging.WARNING):
        final = trainer.train(tiny.init(trainer), tiny.batches(spike_at=range(4, 100)))
    trainer.finish()
    assert final.step == 7  # as in test_divergence: stopped after the checkpoint at step 7
    events = [(b["event"], b["step"]) for b in receiver.received]
    assert events == [
        ("start", 0),
        ("metrics", 2),
        ("metrics", 4),
        ("metrics", 6),
        ("divergence", 7),
        ("end", 7),
    ]
    by_event = {b["event"]: b for b in receiver.received}
    assert set(by_event["metrics"]["metrics"]) == {"train/loss"}
    assert by_event["metrics"]["text"].startswith("r1 step 6: train/loss ")
    assert "loss diverged at step 6" in by_event["divergence"]["text"]
    assert by_event["end"]["text"].startswith("r1 stopped at step 7 of 30: loss diverged")
    assert set(receiver.paths) == {SECRET_PATH}
    # the server answered 500 to each metrics post: warnings, and training went on
    assert notify.failed_posts == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "loomax.hooks.notify"]
    assert len(warnings) == 3
    assert all("could not post the metrics notification" in w for w in warnings)
    assert all("HTTP Error 500" in w for w in warnings)
    assert "s3cr3tKEY" not in caplog.text


def test_a_failing_run_posts_the_error_and_an_unreachable_url_only_warns(
    tiny, tmp_path, receiver, caplog
):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}{SECRET_PATH}"  # nothing listens there
    trainer = tiny.trainer(tmp_path, steps=6)
    good = NotifyHook(url=receiver.url, run_name="r2", num_train_steps=6)
    unreachable = NotifyHook(url=dead, every=1, timeout=2)
    trainer.add_hook(good)
    trainer.add_hook(unreachable)

    @trainer.add_hook(every=3)
    def explode(info):
        raise RuntimeError("boom at step 3")

    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="boom"):
        trainer.train(tiny.init(trainer), tiny.batches())
    trainer.finish()
    texts = [b["text"] for b in receiver.received]
    assert texts == [
        "r2 started at step 0 of 6",
        "r2 failed at step 3: RuntimeError: boom at step 3",
    ]
    # every post to the dead URL failed (start, steps 1-2, the failure) and was a warning only
    assert unreachable.failed_posts == 4
    assert "could not post the failure notification" in caplog.text
    assert "s3cr3tKEY" not in caplog.text


def test_an_aborting_divergence_is_posted_as_divergence(receiver):
    hook = NotifyHook(url=receiver.url, format="json", run_name="r3")
    hook.on_error(StepInfo(12, None, {}), DivergenceError("training loss is nan at step 11"))
    (body,) = receiver.received
    assert body["event"] == "divergence"
    assert body["error"] == "DivergenceError: training loss is nan at step 11"
    assert body["text"] == "r3 diverged: DivergenceError: training loss is nan at step 11"


def test_the_url_is_never_in_a_saved_config(tmp_path):
    path = tmp_path / "run.yaml"
    url = "https://hooks.slack.com" + SECRET_PATH
    path.write_text(f"trainer:\n  hooks:\n    - {{type: notify, url: '{url}', every: 5}}\n")
    config = parse_config(TrainLmConfig, path)
    (hook,) = config.trainer.hooks
    assert hook.url == url and hook.every == 5
    saved = to_yaml(config)
    assert "s3cr3tKEY" not in saved and "s3cr3tKEY" not in repr(config)
    assert "s3cr3tKEY" not in json.dumps(flatten_config(config))  # trackers' hyperparameters
    (saved_hook,) = parse_config(TrainLmConfig, _write(tmp_path, saved)).trainer.hooks
    assert saved_hook.url is None and saved_hook.every == 5  # read back: the env var's turn


def _write(tmp_path, text):
    path = tmp_path / "saved.yaml"
    path.write_text(text)
    return path


def test_bad_settings_are_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("LOOMAX_NOTIFY_URL", raising=False)
    with pytest.raises(ConfigError, match=r"trainer.hooks \(notify\): no URL .*LOOMAX_NOTIFY_URL"):
        NotifyHook()
    NotifyHook(post=False)  # other processes never post: no URL needed there
    with pytest.raises(ValueError, match=r"\(notify\): url must start with http") as error:
        NotifyHook(url="ftp://example.com" + SECRET_PATH)
    assert "s3cr3tKEY" not in str(error.value)
    with pytest.raises(ValueError, match=r"\(notify\): events must be among .*\['stop'\]"):
        NotifyHook(url="http://x", events=["start", "stop"])
    monkeypatch.setenv("MY_HOOK", "file:///etc" + SECRET_PATH)
    with pytest.raises(ConfigError, match=r"URL in \$MY_HOOK must start with") as error:
        NotifyHook(url_env="MY_HOOK")
    assert "s3cr3tKEY" not in str(error.value)
