#!/usr/bin/env python3
"""Thin wrapper: ``python infra/launch.py [options] -- train ...`` is ``loomax launch [options] -- train ...``.

Examples (``--dry-run`` prints the commands instead of running them)::

    python infra/launch.py --target tpu --tpu_name t1 --zone us-central2-b -- train --config_path config/gpt2_small.yaml
    python infra/launch.py --target gpu --hostfile hosts.txt --processes_per_host 8 -- train --config_path ...
    python infra/launch.py --target slurm --nodes 4 -- train --config_path ...
    python infra/launch.py --target local --num_processes 2 -- train --config_path config/quickstart.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout

from loomax.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["launch", *sys.argv[1:]])
