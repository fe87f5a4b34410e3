"""config.json and the ``model`` section: a run's model read from a checkpoint's config.json,
the architecture check, and the config.json an export writes back.

Each family declares which Loomax key every config.json field is (``hf_field_names`` on its
config class); this module reads that table and lists no family:

- ``model_from_hf``: the model of a config.json, with the keys a run gave itself on top
  (training settings win; an architecture key that disagrees is refused, naming the HF
  field and the Loomax key);
- ``written_config``: the config.json of a model imported from one: every imported field
  kept, changed only where training changed what it means, in the imported value's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from loomax.config import ConfigError
from loomax.errors import BadFileError
from loomax.hf.family import family_for, family_of
from loomax.models.config import LmConfig

BOOKKEEPING = ("architectures", "model_type", "vocab_size")
"""config.json fields every family writes that are no model key (the vocabulary is checked
against the run's tokenizer when the weights load)."""


def type_name(cls: type[LmConfig]) -> str:
    """``model.type`` of a config class."""
    return LmConfig.get_choice_name(cls)


def label(config: LmConfig, hf_name: str) -> str:
    """``hidden_size (model.hidden_dim)``: an HF field with the Loomax key it is, if any."""
    key = getattr(config, "hf_field_names", {}).get(hf_name)
    return f"{hf_name} (model.{key})" if key else hf_name


def architecture_differences(config: LmConfig, arch: LmConfig) -> list[str]:
    """The config.json fields where ``config`` and ``arch`` (one family) describe different
    models, each as ``hf (model.key): arch's value in config.json, config's configured``;
    a run's own settings (``hf_run_keys``) and the fields Loomax does not read are not compared."""
    want, have = family_of(config).hf_config(1), family_of(arch).hf_config(1)
    names = getattr(config, "hf_field_names", {})
    skip = {*config.hf_run_keys, *BOOKKEEPING, *(k for k, v in names.items() if v is None)}
    return [
        f"{label(config, k)}: {have.get(k)!r} in config.json, {want.get(k)!r} configured"
        for k in dict.fromkeys([*have, *want])
        if k not in skip and have.get(k) != want.get(k)
    ]


def check_same_architecture(config: LmConfig, arch: LmConfig, where: Any) -> None:
    """``BadFileError`` unless ``config`` is the model config.json describes (``arch``)."""
    if type(config) is not type(arch):
        raise BadFileError(
            f"{where} holds model.type {type_name(type(arch))} (config.json model_type "
            f"{arch.hf_model_type!r}), the configured model is model.type {type_name(type(config))}"
        )
    diff = architecture_differences(config, arch)
    if diff:
        raise BadFileError(f"{where} does not match the configured model ({'; '.join(diff)})")


def model_from_hf(
    hf: dict[str, Any],
    configured: LmConfig | None = None,
    given: Iterable[Sequence[str]] = (),
    where: Any = "config.json",
) -> LmConfig:
    """The model of config.json ``hf`` (``model_type`` picks ``model.type``), with the keys the run gave itself (``given``: key paths inside ``model``)
    taken from ``configured``. Settings such as ``attn_backend``, remat, ``seq_len`` or the
    dropout rates win; an architecture key that disagrees raises ``BadFileError`` naming the
    HF field and the Loomax key; another ``model.type`` raises it too."""
    family = family_for(hf)
    arch = dataclasses.replace(family.from_hf_config(hf), hf_config_json=dict(hf))
    paths = {tuple(p) for p in given if len(p) and p[0] != "hf_config_json"}  # config.json's own
    if configured is None or not paths:
        return arch
    if ("type",) in paths and type(configured) is not family:
        raise BadFileError(
            f"{where} holds model.type {type_name(family)} (config.json model_type "
            f"{hf.get('model_type')!r}), the run sets model.type {type_name(type(configured))}; "
            "leave model.type out to read it from config.json"
        )
    try:
        merged = _overlay(arch, configured, paths - {("type",)})
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"{where}: the run's model keys do not fit config.json's model: {e}"
        ) from e
    check_same_architecture(merged, arch, where)
    return merged


def _overlay(base: Any, source: Any, paths: Iterable[tuple[str, ...]]) -> Any:
    """``base`` with the values at ``paths`` taken from ``source`` (a section whose ``type`` is
    given, or whose kind differs, is taken whole)."""
    heads: dict[str, list[tuple[str, ...]]] = {}
    for path in paths:
        heads.setdefault(path[0], []).append(path[1:])
    changes = {}
    for head, rests in heads.items():
        value, under = getattr(source, head), getattr(base, head, None)
        nested = (
            all(rests)
            and ("type",) not in rests
            and dataclasses.is_dataclass(value)
            and type(under) is type(value)
        )
        changes[head] = _overlay(under, value, rests) if nested else value
    return dataclasses.replace(base, **changes)


def describe(config: LmConfig, given: Iterable[Sequence[str]] = ()) -> str:
    """One line: the model read from config.json, in Loomax's keys, and the run's own keys."""
    keys = dict.fromkeys(k for k in getattr(config, "hf_field_names", {}).values() if k)
    shown = []
    for key in ("vocab_size", *keys):
        value = config
        for part in key.split("."):
            value = getattr(value, part, None)
        if value is not None and not dataclasses.is_dataclass(value):
            shown.append(f"{key} {value}")
    own = sorted(".".join(p) for p in given if len(p) and p[0] not in ("type", "hf_config_json"))
    text = f"model.type {type_name(type(config))} ({', '.join(shown)})"
    return text + (f"; the run's own: {', '.join(own)}" if own else "")


def written_config(
    config: LmConfig, vocab_size: int, written: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``(config.json, the fields changed)`` for a model of ``config`` with ``vocab_size``
    entries; ``written`` are fields the export sets itself (``torch_dtype``, token ids).

    With no imported config.json (``config.hf_config_json``) it is the family's own
    ``hf_config``, nothing listed. Otherwise every imported field is kept, and a field is
    written only where the model's means something else than the imported one did (a run's
    own settings, ``hf_run_keys``, never: the context length, dropout, the balance loss
    weight; nor the fields Loomax does not read), in the imported value's type; fields the
    export sets are written where they differ from the imported."""
    family = family_of(config)
    fresh = family.hf_config(vocab_size)
    base = config.hf_config_json
    if not base or base.get("model_type") != family.hf_model_type:
        return {**fresh, **(written or {})}, []
    before = family_of(type(config).from_hf_config(base)).hf_config(base.get("vocab_size", 1))
    names = getattr(config, "hf_field_names", {})
    unread = {k for k, v in names.items() if v is None and k in base}  # kept as imported
    out, changed = dict(base), []
    for key, value in fresh.items():
        if key not in {*config.hf_run_keys, *unread} and value != before.get(key):
            out[key] = _typed(value, base.get(key))
            changed.append(key)
    for key, value in (written or {}).items():
        if key == "torch_dtype" and "dtype" in base:  # transformers 5 writes `dtype`
            key = "dtype"
        if value != base.get(key):
            out[key] = _typed(value, base.get(key))
            changed.append(key)
    for key in list(changed):  # an imported field of the same key the fresh ones replace
        target = names.get(key)
        for other, meant in names.items():
            if other in out and other not in fresh and target and meant and _related(target, meant):
                del out[other]
                changed.append(other)
    return out, changed


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _typed(value: Any, like: Any) -> Any:
    """``value`` in the type of the imported ``like`` where that loses nothing (256.0 -> 256)."""
    if isinstance(value, bool) or isinstance(like, bool):
        return value
    if isinstance(like, int) and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(like, float) and isinstance(value, int):
        return float(value)
    return value
