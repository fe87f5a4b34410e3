"""Will it fit? Compile a run's real train step for a TPU topology (or the local devices)
on any host, and rank sharding strategies by what the compiler says.

``loomax compile`` is ``compile_run``; ``loomax plan`` is ``search``. See docs/planning.md.
"""
