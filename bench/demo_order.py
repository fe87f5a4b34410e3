"""The demo's first batches (issue 61): run from a checkout of any commit, it prints the sha256
of batches 0-4 of `config/quickstart.yaml` as `loomax train` loads them, and (where
`data.stream_while_building: auto` exists) the order line. Run it on two commits with the same
cache folder and compare the digests (`bench/results/demo_order_main_vs_i61_2026-11-29.txt`).

    python bench/demo_order.py [CACHE_DIR]   # from the repository root
"""

import hashlib
import sys

from loomax.config import parse_config
from loomax.data import build_lm_datasets
from loomax.lm import TrainLmConfig
from loomax.train_lm import make_loader


def main() -> None:
    cache = sys.argv[1] if len(sys.argv) > 1 else "/tmp/loomax-demo-order-cache"
    config = parse_config(TrainLmConfig, "config/quickstart.yaml", ["--data.cache_dir", cache])
    try:
        from loomax.data.order import choose_order
    except ImportError:  # a commit before `auto`
        print("stream_while_building =", config.data.stream_while_building)
    else:
        order = choose_order(config.data)
        print(order.describe(config.data.stream_chunk_shards))
        assert not order.streaming
    data = build_lm_datasets(config.data, config.model.seq_len)
    loader = make_loader(config, data)
    digest = hashlib.sha256()
    for step in range(5):
        digest.update(loader.batch(step).tobytes())
    print("windows", data.num_train_windows, "digest of batches 0-4:", digest.hexdigest())


if __name__ == "__main__":
    main()
