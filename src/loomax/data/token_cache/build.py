"""Building a token cache: documents tokenized in parallel by Ray into flat tensorstore arrays.

`build_token_cache` tokenizes each shard in a Ray task (`tasks`), which writes the
shard's tokens to a piece of its own and then records the shard in the ledger. Once the
ledger holds every shard needed, the driver copies the pieces into one flat array per
split (`assemble`) and writes `meta.json` last. An interrupted build (driver killed, a
task failed) resumes from the ledger (`ledger`): rerunning it tokenizes only the shards
the ledger lacks, and the result is the same, token for token. A complete cache whose
files are no longer those it was written with (`damage.find_damage`) is rebuilt from its
sources, which the fingerprint has just checked. See `layout` for what is stored where.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tqdm import tqdm

from loomax.data.cache import fingerprint
from loomax.data.record_shards import RecordShards
from loomax.data.sources import Shard
from loomax.data.token_cache.damage import find_damage
from loomax.data.token_cache.finish import clean_up, finish, info
from loomax.data.token_cache.layout import META_FILE, TokenCacheError
from loomax.data.token_cache.lease import BuildLease
from loomax.data.token_cache.ledger import claim, entry_tokens, pieces_left, read_ledger
from loomax.data.token_cache.placement import runs_here
from loomax.data.token_cache.priority import autogroup_id
from loomax.data.token_cache.settings import BuildPlan, TokenCacheInfo, cache_settings
from loomax.data.token_cache.tasks import FENCE_LOST, FenceLost, PieceJob, build_piece
from loomax.data.tokenizer import bos_id, eos_id, load_tokenizer, resolve_tokenizer_path
from loomax.distributed import RayConfig, ray_session
from loomax.errors import DataSourceError
from loomax.storage import Directory, to_url

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""Niceness added to the Ray workers that tokenize a build's shards from `background_from` on."""


def build_token_cache(
    shards: Sequence[Shard],
    tokenizer_path: str | os.PathLike,
    cache_url: str | os.PathLike,
    *,
    max_documents: int | None = None,
    holdout_fraction: float = 0.0,
    holdout_seed: int = 0,
    bos: bool = False,
    skip_bad_records: bool = False,
    overwrite: bool = False,
    ray_config: RayConfig = RayConfig(),
    progress: bool = True,
    before_piece: Callable[[Shard], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    fast_encoder: bool = True,
    background_from: int | None = None,
    held: Callable[[], bool] | None = None,
    lease: BuildLease | None = None,
    repair: bool = True,
) -> TokenCacheInfo:
    """Tokenizes `shards` with Ray into a token cache at `cache_url`, or resumes that build.

    Documents are ordered by shard, then within it; `max_documents` keeps the first
    that many. Each becomes its tokens followed by EOS (preceded by BOS if `bos`),
    exactly as `encode_documents` makes them. A complete cache with the same settings is
    returned as is; one with other settings raises `TokenCacheError` naming what
    differs, unless `overwrite` deletes it first. `ray_config` says which Ray cluster
    to use; if Ray is already initialized it is used as is.
    `memory://` caches are built in this process, since Ray workers cannot see them, and
    so are local corpora under `placement.SMALL_BUILD_BYTES` when no Ray is running.

    `before_piece`, for tests and fault drills, is called with each shard to tokenize,
    in the task that tokenizes it (a Ray worker: it must pickle, e.g. a closure), before
    the shard is read: it may sleep to slow the build down, or raise to fail that task.
    It is not part of the cache's settings.

    `should_stop`, polled about once a second while shards are tokenized, ends the build
    early when it returns True (no new task starts; those running finish and record their
    shards, as do finished ones) by raising `BuildStopped`.

    `fast_encoder` lets the tasks encode with tiktoken where `fast_encoder.fast_encoder`
    shows it gives the tokenizer's ids (the cache is the same, byte for byte, either way).
    `background_from`: the Ray tasks of the shards from this position on raise their
    worker's niceness by `BACKGROUND_NICE` (a streaming run's build past its first chunk,
    which the training process next to it waits on less than on its own compile and
    steps). Their worker processes stay that nice. The first of them starts once every
    earlier shard's task has ended: the tasks on a Ray node share its autogroup, whose nice
    each task sets as it starts, and Ray does not start tasks in the order they were
    submitted, so a first-chunk task starting late would set the group back to 0 under a
    background one (the ledger's `autogroup_nice` recorded it once). While `held()` is
    true those tasks also run at most (Ray CPUs - 1) at a time, at least one: a streaming
    run holds its build so until its first step, leaving a core to its compiles.

    `lease`, the cache's build lease this process holds (`shared.build_shared`): every
    write of the finish phase and every repair is fenced on it (`finish`), and the tasks
    record their shards only while it holds their fence. `repair=False` (a run that does
    not hold the lease) raises `CacheNeedsRepair` instead of touching a complete cache
    that is damaged or still has its pieces.
    """
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or null, got {max_documents}")
    if not shards:
        raise DataSourceError("token cache: no shards to tokenize")
    tokenizer_file = resolve_tokenizer_path(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_file)
    settings = cache_settings(
        shards,
        tokenizer_file,
        max_documents=max_documents,
        holdout_fraction=holdout_fraction,
        holdout_seed=holdout_seed,
        bos=bos,
    )
    build = BuildPlan(
        root=Directory(to_url(cache_url)),
        shards=shards,
        settings=settings,
        key=fingerprint(settings),
        tokenizer_file=tokenizer_file,
        token_ids={
            "vocab_size": tokenizer.get_vocab_size(),
            "eos_id": eos_id(tokenizer),
            "bos_id": bos_id(tokenizer) if bos else None,  # raises now if there is none
        },
        skip_bad_records=skip_bad_records,
        fast_encoder=fast_encoder,
        background_from=background_from,
        fence=None if lease is None else lease.fence,
    )

    def before_repair(why: str) -> None:
        if not repair:
            raise CacheNeedsRepair(f"token cache {build.root}: {why}")
        if lease is not None:
            lease.confirm()

    meta, tokenized = claim(build, overwrite, before_repair), []
    problem = None if meta is None else find_damage(build.root, meta)
    if problem is not None:  # same settings, sources just fingerprinted: safe to rebuild
        before_repair(f"damaged ({problem})")
        logger.warning("token cache %s is damaged (%s): rebuilding it", build.root, problem)
        build.root.delete(first=META_FILE)
        meta = claim(build, overwrite, before_repair)
    if meta is not None and pieces_left(build.root):
        before_repair("its pieces are left")
    if meta is None:
        ledger = read_ledger(build)
        before = set(ledger)
        if isinstance(shards, RecordShards):
            shards.learn_end(ledger)
        if build.shards_used(ledger) is None:
            jobs: Iterable[PieceJob] = (
                _stream_jobs(build, shards, ledger, before_piece)
                if isinstance(shards, RecordShards)
                else [_job(build, i, before_piece) for i in range(len(shards)) if i not in ledger]
            )
            _tokenize_missing(build, jobs, ledger, ray_config, progress, should_stop, held)
        tokenized = [entry for position, entry in ledger.items() if position not in before]
        meta = finish(build, ledger, lease)
    if pieces_left(build.root):
        clean_up(build.root, lease)
    return info(build.root, meta, tokenized)


class CacheNeedsRepair(TokenCacheError):
    """A complete cache needs a repair (or its pieces deleted), which only the holder of its
    build lease may do (`build_token_cache(repair=False)`)."""


def _job(build: BuildPlan, position: int, before_piece: Callable[[Shard], None] | None) -> PieceJob:
    return PieceJob(
        position=position,
        shard=build.shards[position],
        root_url=build.root.url,
        fingerprint=build.key,
        tokenizer_sha256=build.settings["tokenizer_sha256"],
        bos_id=build.token_ids["bos_id"],
        max_documents=build.max_documents,
        holdout_fraction=build.holdout["fraction"],
        holdout_seed=build.holdout["seed"],
        skip_bad_records=build.skip_bad_records,
        before_piece=before_piece,
        fast_encoder=build.fast_encoder,
        nice=BACKGROUND_NICE
        if build.background_from is not None and position >= build.background_from
        else 0,
        driver_autogroup=autogroup_id(),
        fence=build.fence,
    )


def _stream_jobs(
    build: BuildPlan,
    shards: RecordShards,
    ledger: dict[int, dict],
    before_piece: Callable[[Shard], None] | None,
) -> Iterator[PieceJob]:
    """The jobs of the logical shards the ledger lacks, each with its documents, read from
    the source's stream as the tasks take them (the shards the ledger holds are read past)."""
    for position, documents, skipped in shards.read(
        skip_bad_records=build.skip_bad_records, max_documents=build.max_documents
    ):
        if position not in ledger:
            job = _job(build, position, before_piece)
            yield dataclasses.replace(job, documents=documents, skipped=skipped)


# ---------------------------------------------------------------------- tokenizing
NODE_FAILURE_RETRIES = 3
"""Times the build resubmits a shard whose task Ray lost (worker or node died) and gave up on."""

_Outcome = tuple[PieceJob, "dict[str, Any] | BaseException"]


def _tokenize_missing(
    build: BuildPlan,
    jobs: Iterable[PieceJob],
    ledger: dict[int, dict],
    ray_config: RayConfig,
    progress: bool,
    should_stop: Callable[[], bool] | None = None,
    held: Callable[[], bool] | None = None,
) -> None:
    """Runs `jobs` (the shards the ledger lacks), in order, until the shards used are all in it.

    Runs on Ray, or in this process (`placement.runs_here`: memory:// caches, small local
    corpora with no Ray running). Raises `TokenCacheError` naming the first shard that
    failed, after the shards already running have finished.
    """
    tokenizer_json = build.tokenizer_file.read_text(encoding="utf-8")
    if runs_here(build, ray_config):
        _collect(build, ledger, _run_here(jobs, tokenizer_json, should_stop), progress)
        return
    with ray_session(ray_config):
        runner = _run_on_ray(jobs, tokenizer_json, should_stop, held)
        _collect(build, ledger, runner, progress)


def _collect(
    build: BuildPlan, ledger: dict[int, dict], runner: Iterator[_Outcome], progress: bool
) -> None:
    """Adds the outcomes of `runner` to `ledger`, with a progress bar; raises on failure."""
    failures: list[tuple[PieceJob, BaseException]] = []
    tokens = sum(entry_tokens(entry) for entry in ledger.values())
    bar = tqdm(
        total=None if isinstance(build.shards, RecordShards) else len(build.shards),
        initial=len(ledger),
        desc="token cache",
        unit="shard",
        file=sys.stderr,
        disable=not progress,
    )
    try:
        for job, outcome in runner:
            if isinstance(outcome, dict) and FENCE_LOST in outcome:  # the lease moved on
                failures.insert(0, (job, FenceLost(outcome[FENCE_LOST])))
                break  # no more tasks: this builder stops (`BuildStopped` below)
            if isinstance(outcome, BaseException):
                failures.append((job, outcome))
                continue
            ledger[job.position] = outcome
            tokens += entry_tokens(outcome)
            bar.update()
            bar.set_postfix(tokens=f"{tokens:,}")
            if not failures and build.shards_used(ledger) is not None:
                break
    finally:
        runner.close()
        bar.close()
    if failures:
        job, error = failures[0]
        if isinstance(error, FenceLost):  # the lease moved on: this builder stops
            raise BuildStopped(f"token cache: the build lease was lost ({error})")
        raise TokenCacheError(
            f"token cache: tokenizing shard {job.shard.name} failed "
            f"({len(failures)} shard(s) failed; finished shards are kept, rerun to resume): "
            f"{type(error).__name__}: {error}"
        ) from error


class BuildStopped(TokenCacheError):
    """The build ended early because its `should_stop` said so (finished shards are kept)."""


def _run_on_ray(
    jobs: Iterable[PieceJob],
    tokenizer_json: str,
    should_stop: Callable[[], bool] | None = None,
    held: Callable[[], bool] | None = None,
) -> Iterator[_Outcome]:
    """Runs `jobs` as Ray tasks, a few per CPU at a time, in order; yields them as they end.

    After the first failure no new task starts, but running ones finish (their work is
    kept in the ledger). Closing the iterator (a stop, a failure) starts no new task and
    cancels none: the tasks still in flight finish their shards and record them, or die
    with this driver. Ray 2.60 aborts the driver (``Check failed: it !=
    submissible_tasks_.end() Tried to complete task that was not pending``) when a
    ``ray.cancel`` races the reply of a task just finishing (ray-project/ray#54798 fixed
    one such race): twice in two streaming runs that ended with 4 of 768 shards in flight.
    """
    import ray  # only here: reading a cache, or building one in memory, needs no Ray

    # spread over the nodes; a task lost with its worker or node is rerun by Ray, and
    # again by this loop (up to NODE_FAILURE_RETRIES times) if Ray gives up on it
    task = ray.remote(build_piece).options(scheduling_strategy="SPREAD", max_retries=3)
    tokenizer_ref = ray.put(tokenizer_json)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    in_flight = 2 * cpus
    pending, queue, running, failed = iter(jobs), deque(), {}, False  # queue: jobs to rerun
    lost: dict[int, int] = {}  # position: times its task was lost to a system failure
    while True:
        while not failed and len(running) < in_flight:
            job = queue.popleft() if queue else next(pending, None)  # read as needed
            if job is None:
                break
            if job.nice and any(not other.nice for other in running.values()):
                queue.appendleft(job)  # one autogroup nice at a time: see `build_token_cache`
                break
            if job.nice and held is not None and len(running) >= max(1, cpus - 1) and held():
                queue.appendleft(job)  # background shards wait: see `build_token_cache`
                break
            running[task.remote(job, tokenizer_ref)] = job
        if not running:
            return
        ready: list = []
        while not ready:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            if should_stop is not None and should_stop():
                raise BuildStopped("token cache: build stopped (finished shards are kept)")
        [ref] = ready
        job = running.pop(ref)
        try:
            outcome: dict[str, Any] | BaseException = ray.get(ref)
        except ray.exceptions.RayTaskError as error:  # the task itself raised
            outcome, failed = getattr(error, "cause", None) or error, True
        except ray.exceptions.RayError as error:  # its worker or node died
            lost[job.position] = lost.get(job.position, 0) + 1
            if lost[job.position] <= NODE_FAILURE_RETRIES:
                queue.appendleft(job)
                continue
            outcome, failed = error, True
        yield job, outcome


def _run_here(
    jobs: Iterable[PieceJob],
    tokenizer_json: str,
    should_stop: Callable[[], bool] | None = None,
    held: Callable[[], bool] | None = None,
) -> Iterator[_Outcome]:
    """Runs `jobs` one by one in this process (for stores other processes cannot see),
    at this process's own priority (no `nice`: it may be the training process). `held`
    changes nothing here (one shard at a time already); it is `_run_on_ray`'s signature."""
    for job in jobs:
        if should_stop is not None and should_stop():
            raise BuildStopped("token cache: build stopped (finished shards are kept)")
        try:
            yield job, build_piece(dataclasses.replace(job, nice=0), tokenizer_json)
        except Exception as error:  # reported by the caller, like a failed Ray task
            yield job, error
            return
