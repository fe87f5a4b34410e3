"""Direct preference optimisation as a task on the shared trainer.

Modules: ``config`` (the ``dpo`` section and the run's ``TrainDpoConfig``), ``pairs``
(preference pairs from jsonl, tokenised, with response masks), ``loss`` (sequence
log-probs and the sigmoid / IPO / SimPO losses with TRL's metric names), ``reference``
(the reference model's log-probs, computed once before training and cached), ``run``
(``train_dpo``: the job ``loomax dpo`` runs), ``synthetic`` (the shipped preference set's
generator). Imports nothing here.
"""
