"""Worker for the multi-process downstream test: train a tiny Llama 2 steps with the
``downstream_eval`` hook (at the end) on a mesh of data=2 x model=2, print its metrics.

  python multiprocess_run.py single TASKS_DIR TOKENIZER RUN_DIR             # 1 process, 4 devices
  python multiprocess_run.py process ID 2 PORT TASKS_DIR TOKENIZER RUN_DIR  # 1 of 2, 2 devices each
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from loomax.data import BatchLoader, TokenWindows  # noqa: E402
from loomax.data.tokenizer import load_tokenizer  # noqa: E402
from loomax.distributed import DistributedConfig  # noqa: E402
from loomax.hooks import DownstreamEvalHook  # noqa: E402
from loomax.lm import lm_loss  # noqa: E402
from loomax.mesh import MeshConfig  # noqa: E402
from loomax.models import LlamaConfig  # noqa: E402
from loomax.optim import AdamConfig  # noqa: E402
from loomax.tracking import NoopTrackerConfig  # noqa: E402
from loomax.train import Trainer, TrainerConfig, setup_process  # noqa: E402

MODEL = LlamaConfig(
    seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2
)


def run(tasks_dir: str, tokenizer_path: str, run_dir: str, distributed: DistributedConfig) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size()
    config = TrainerConfig(
        num_train_steps=2,
        train_batch_size=4,
        mesh=MeshConfig(1, 2, 2),
        progress_bar=False,
        tracker=NoopTrackerConfig(),
        run_dir=run_dir,
        distributed=distributed,
    )
    trainer = Trainer(config, AdamConfig(learning_rate=1e-2, warmup=0).build(2), lm_loss(),
                      run_id=setup_process(config))  # fmt: skip
    hook = DownstreamEvalHook(
        every=1000, tasks=["tiny_mc", "tiny_ppl", "tiny_gen"], include_path=tasks_dir,
        default_tasks=False, batch_size=4, bootstrap_iters=0, tokenizer=tokenizer,
    )  # fmt: skip
    trainer.add_hook(hook)
    tokens = np.random.default_rng(0).integers(0, vocab, 20 * MODEL.seq_len, dtype=np.int32)
    batches = BatchLoader(TokenWindows(tokens, MODEL.seq_len), 4, seed=0)
    state = trainer.initial_state(lambda key: MODEL.build(vocab, key=key))
    up = state.model.blocks.stacked.mlp.up_proj.weight.array
    trainer.train(state, batches.iter_from(0, jax.process_index(), jax.process_count()))
    trainer.finish()
    ((step, metrics),) = hook.history
    return {
        "step": step,
        "metrics": metrics,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "mlp_up_spec": str(up.sharding.spec),
        "torch_imported": "torch" in sys.modules,  # lm-eval's env report and torch seed
    }


def main() -> None:
    if sys.argv[1] == "single":
        print(json.dumps(run(*sys.argv[2:5], DistributedConfig())))
    else:
        pid, count, port = map(int, sys.argv[2:5])
        dist = DistributedConfig(
            coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
        )
        print(json.dumps(run(*sys.argv[5:8], dist)))


if __name__ == "__main__":
    main()
