"""`data.stream_while_building`: train while the token caches build.

`streaming_datasets` is `build_lm_datasets` for that mode. The tokenizer and the
validation sources' caches (usually small) are ready before it returns, as before; each
train source's cache is built on a background thread (`BackgroundBuilds`, under the
cache's lease, so another run building it is waited for or taken over), and its windows
(`GrowingWindows`) are read from the shards done so far, in an order that does not
depend on how far the build is. It returns once the first chunk of every train source is
built. Without `data.validation`, the validation documents are those held out of each
train source's first chunk (known before training starts, the same on every run).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np

from loomax.config import ConfigError
from loomax.data.background_build import BackgroundBuilds
from loomax.data.config import DataConfig
from loomax.data.dataset import LmDatasets, build_caches, cache_plan
from loomax.data.growing_windows import GrowingWindows
from loomax.data.record_shards import RecordShards
from loomax.data.run_tokenizer import prepare_tokenizer
from loomax.data.token_cache import TokenCache
from loomax.data.token_cache.layout import META_FILE
from loomax.data.token_cache.partial import GrowingCache
from loomax.data.token_cache.shared import build_shared
from loomax.data.tokenizer import eos_id, load_tokenizer
from loomax.data.windows import TokenWindows
from loomax.distributed import RayConfig, barrier, coordination_client
from loomax.errors import DataSourceError
from loomax.storage import Directory, to_url

logger = logging.getLogger(__name__)


def check_streaming(config: DataConfig) -> None:
    """`ConfigError` for what `stream_while_building` cannot do, before any work."""
    for i, source in enumerate(config.train):
        if source.max_documents is not None:
            raise ConfigError(
                f"data.train[{i}].max_documents cannot be used with "
                "data.stream_while_building: true (the shards are read whole); remove one"
            )


def streaming_datasets(
    config: DataConfig,
    seq_len: int,
    *,
    ray: RayConfig | None = None,
    say_every_s: float = 10.0,
) -> LmDatasets:
    """The tokenizer and windows of `config` for `seq_len`, the train caches still building.

    Call `close()` on the result when training ends: it stops the builds left running.
    With several JAX processes only process 0 builds; the others read what it has built.
    """
    check_streaming(config)
    primary = coordination_client() is None or _process_index() == 0
    tokenizer_path = prepare_tokenizer(config) if primary else None
    if primary:
        _, validation_infos = build_caches(config, tokenizer_path, ray=ray, kinds=("validation",))
    barrier("loomax_data_tokenizer", timeout=24 * 3600)
    if not primary:
        tokenizer_path = prepare_tokenizer(config)
        _, validation_infos = build_caches(
            config, tokenizer_path, ray=ray, progress=False, kinds=("validation",)
        )
    tokenizer = load_tokenizer(tokenizer_path)
    background = BackgroundBuilds(ray or RayConfig())
    plans = [cache_plan(config, tokenizer_path, "train", i, s) for i, s in enumerate(config.train)]
    if primary and any(_needs_ray(plan.url) for plan in plans):
        background.ensure_ray()  # here, in the main thread (Ray's signal handlers), once
    train = []
    for i, plan in enumerate(plans):
        name = f"data.train[{i}]"
        windows = GrowingWindows(
            GrowingCache(plan.url, plan.key, _shard_names(plan.shards)),
            seq_len,
            config.stream_chunk_shards,
            name,
            failure=functools.partial(background.error, name),
            say_every_s=say_every_s,
        )
        if primary:
            build = functools.partial(
                _build, plan, str(tokenizer_path), config, ray, background.held
            )
            background.start(name, build, windows)
        train.append(windows)
    try:
        for windows in train:
            windows.wait_for(1)
            logger.info("%s: training starts on %s", windows.name, windows.progress())
        if config.validation:
            pieces = [TokenCache.open(info.url)["train"].as_numpy() for info in validation_infos]
        else:
            pieces = [_first_chunk_held_out(windows) for windows in train]
            if sum(len(piece) for piece in pieces) < seq_len:
                pieces = _first_chunks_tails(train, config.validation_fraction, seq_len)
        validation = TokenWindows(np.concatenate(pieces), seq_len)
        if len(validation) == 0:
            raise DataSourceError(
                f"the validation data has {validation.num_tokens} tokens, fewer than "
                f"seq_len={seq_len} needed for one window: with data.stream_while_building "
                "the documents held out are those of each train source's first chunk; raise "
                "data.stream_chunk_shards or data.validation_fraction, or give data.validation"
            )
    except BaseException:
        background.close()
        raise
    return LmDatasets(
        tokenizer=tokenizer,
        tokenizer_path=str(tokenizer_path),
        eos_id=eos_id(tokenizer),
        vocab_size=tokenizer.get_vocab_size(),
        train=train,
        validation=validation,
        caches=[w.cache.root.url for w in train] + [i.url for i in validation_infos],
        validation_sets=[TokenWindows(p, seq_len) for p in pieces],
        background=background,
    )


def _build(plan, tokenizer_path, config, ray, held, should_stop):
    """One train cache's build under its lease (run on a background thread)."""
    return build_shared(
        plan.shards,
        tokenizer_path,
        plan.url,
        **plan.settings,
        skip_bad_records=config.skip_bad_records,
        fast_encoder=config.fast_encoder != "off",
        background_from=config.stream_chunk_shards,  # the first chunk at full priority
        held=held,  # and the rest narrowed to leave a core, until the first step
        ray_config=ray or RayConfig(),
        progress=False,
        should_stop=should_stop,
    )


def _shard_names(shards) -> Sequence[str]:
    """The names of a cache's shards in order; open-ended for a source cut into logical
    shards as it is read (`records_per_shard`: learned from the ledger as it grows)."""
    if isinstance(shards, RecordShards):
        return RecordShards(shards.source).names  # its own: the build's learns apart
    return [shard.name for shard in shards]


def _needs_ray(url: str) -> bool:
    """Whether building the cache at `url` takes Ray: not complete, and not `memory://`."""
    return not url.startswith("memory://") and not Directory(to_url(url)).exists(META_FILE)


def _first_chunk_held_out(windows: GrowingWindows) -> np.ndarray:
    """The held-out (validation) tokens of the shards of `windows`' first chunk, in order."""
    shards = windows.chunk_shards_of(0)
    ranges = [(p, 0, windows.cache.tokens(p, "validation")) for p in shards]
    parts = windows.cache.read(ranges, split="validation")
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _first_chunks_tails(
    train: list[GrowingWindows], fraction: float, seq_len: int
) -> list[np.ndarray]:
    """When the documents held out of the first chunks make no window: the last
    `fraction` of each first chunk's windows (at least one, if one is left to train on),
    taken out of training. A function of the first chunks alone, so every run decides alike."""
    pieces, said = [], []
    for windows in train:
        built = windows.first_chunk_windows
        held = 0 if built < 2 else min(max(1, round(fraction * built)), built - 1)
        pieces.append(windows.hold_out_first_chunk_tail(held))
        said.append(f"the last {held} of {built} windows of {windows.name}'s first chunk")
    logger.warning(
        "the documents held out of the train sources' first chunks (data.validation_fraction="
        "%g) make fewer than one window of seq_len=%d: holding out %s for validation instead",
        fraction,
        seq_len,
        ", ".join(said),
    )
    return pieces


def _process_index() -> int:
    import jax

    return jax.process_index()
