"""Reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO) as a task on the shared trainer.

Modules: ``config`` (the ``rl`` section, ``TrainRlConfig``), ``tasks`` (prompt files and the
shipped sorting task), ``rewards`` (the registry and the shipped rewards, one file each),
``rollout`` (batched KV-cache sampling on the training mesh), ``advantages`` (group
normalisation, dynamic sampling), ``loss`` (the clipped, KL-regularised policy loss and its
normalisations), ``batches`` (a rollout made ready to train on), ``stream`` (the rollout
batch stream, a hook of the trainer), ``evaluate`` (held-out scoring), ``warm_start``
(supervised steps before RL), ``run`` (``train_rl``: the job ``loomax rl`` runs),
``command``. Imports nothing here.
"""
