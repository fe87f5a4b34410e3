"""Chat SFT data: conversations rendered by a chat template, a loss mask, packed rows.

Modules (each imports nothing here): ``config`` (the ``data.chat`` section), ``templates``
(the shipped templates), ``render`` (Jinja rendering as transformers does it),
``encode`` (token ids and the per-token loss mask), ``packing`` (conversations into
full rows with document ids), ``dataset`` (jsonl files into packed windows for the loader).
"""
