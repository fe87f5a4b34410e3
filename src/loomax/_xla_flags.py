"""XLA flags Loomax turns on by default, before JAX starts its backends; and reading
which CPU kernel libraries a compiled program calls.

None by default, measured: on this JAX (0.10.2) XLA's CPU backend already hands the
matmuls to YNNPACK (``__ynn_fusion``), and no flag set measured by ``bench/cpu_flags.py``
beat that on the GPT-2 bench config (bench/README.md, "XLA CPU flags"). The former default
``--xla_cpu_use_onednn=true`` compiled to the same program (same library calls) and was
dropped; ``--xla_cpu_experimental_ynn_fusion_type=`` (no YNNPACK) changed the losses' last
bits. ``DEFAULT_XLA_FLAGS`` stays the one place to add a flag that measures faster: a flag
already present in ``XLA_FLAGS`` is left as the user set it, and ``LOOMAX_XLA_DEFAULTS=0``
turns the defaults off.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

DEFAULT_XLA_FLAGS: dict[str, str] = {}


def append_xla_flags(flags: Mapping[str, str]) -> None:
    """Append each ``--name: value`` of ``flags`` to ``XLA_FLAGS`` unless ``--name`` is there already."""
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f"{name}={value}" for name, value in flags.items() if name not in current]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def apply_default_xla_flags() -> None:
    """Append ``DEFAULT_XLA_FLAGS`` to ``XLA_FLAGS`` unless set already or disabled."""
    if os.environ.get("LOOMAX_XLA_DEFAULTS", "1") == "0":
        return
    append_xla_flags(DEFAULT_XLA_FLAGS)


LIBRARY_CALLS = ("onednn", "xnn", "ynn")
"""The CPU kernel libraries XLA can hand work to; see ``library_calls``."""


def library_calls(hlo_text: str) -> dict[str, int]:
    """How many fusions or custom calls of compiled CPU HLO go to each of ``LIBRARY_CALLS``.

    XLA marks them ``__onednn_fusion``, ``__xnn_fusion``, ``__ynn_fusion`` (fusion kinds) or
    ``__onednn$matmul`` (oneDNN custom calls); the count shows whether a flag took effect.
    """
    counts = {}
    for name in LIBRARY_CALLS:
        counts[name] = len(
            re.findall(rf'"kind":"__{name}_fusion"|custom_call_target="__{name}\$', hlo_text)
        )
    return counts


def hlo_fingerprint(hlo_text: str) -> str:
    """A short hash of compiled HLO without its metadata: equal for flags that compile alike."""
    import hashlib

    stripped = re.sub(r", metadata=\{[^}]*\}|^HloModule [^\n]*", "", hlo_text, flags=re.M)
    return hashlib.sha1(stripped.encode()).hexdigest()[:12]
