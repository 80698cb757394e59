"""From Settings to a ready Engine: offline hub, fixed threads, model, reuse pool, disk tier."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from memrad.config import (AffinitySettings, DiskSettings, EngineSettings, ModelSettings, PoolSettings, ReuseSettings,
                           ServerSettings, Settings)
from memrad.engine.state.disk import DiskTier, state_format
from memrad.engine.threads import pin
from memrad.engine.engine import Engine, EngineOptions, FinishHook
from memrad.engine.parking import NoDisk
from memrad.engine.model.loader import LoadedModel, default_pool_bytes, load_model, resolve_threads
from memrad.paths import sessions_dir
from memrad.reuse.pool import ReusePool
from memrad.private import private_dir

log = logging.getLogger("memrad")


def build_engine(settings: Settings) -> Engine:
    """Load the configured model and wrap it in an Engine; logs what it chose and why."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    threads = resolve_threads(settings.model.threads)
    pin(threads)
    started = time.perf_counter()
    loaded = load_model(settings.model.name, settings.model.device, settings.model.dtype,
                        progress=lambda msg: log.info("%s", msg), weights=settings.model.weights,
                        context=settings.model.context, prefill_attention=settings.engine.prefill_attention,
                        kv_dtype=settings.model.kv_dtype)
    log.info("loaded %s in %.1f s on %s (%s, %s weights, %d threads, prefill chunk %d, context %d %s)",
             loaded.model_id, time.perf_counter() - started, loaded.device.type, loaded.dtype_name,
             loaded.weights_name, threads, settings.engine.prefill_chunk, loaded.context_len,
             loaded.context.describe())
    engine = engine_for(loaded, settings, threads)
    if settings.engine.compile == "on":
        engine.start_background()  # before serving; auto starts once the daemon listens (memrad.daemon)
    log.info("decode: %s (%s)", engine.decoder.choice.value, engine.decoder.choice.reason)
    if settings.pool.enabled:
        openers = ", ".join(sorted(loaded.tokenizer.convert_ids_to_tokens(list(engine.openers))))
        log.info("affinity: %s; longest prefix: %s; message openers: %s",
                 "on" if settings.affinity.enabled else "off (MEMRA_AFFINITY=0)",
                 "on" if settings.affinity.longest_prefix else "off (MEMRA_LONGEST_PREFIX=0)",
                 openers or "none found in the chat template (implicit nomination never fires)")
    return engine


def engine_for(loaded: LoadedModel, settings: Settings, threads: int,
               on_finished: FinishHook | None = None) -> Engine:
    """The one way from a loaded model and Settings to an Engine: the pool, the disk tier
    and the flags as configured (the daemon, and the benches that drive an engine in process)."""
    pool, disk = None, NoDisk()  # the one place that chooses the tiers
    if settings.pool.enabled:
        max_bytes = settings.pool.max_bytes or default_pool_bytes(loaded.device)
        pool = ReusePool(settings.pool.max_sessions, max_bytes, settings.pool.sessions_per_name)
        log.info("reuse pool: %s mode, up to %d sessions and %.1f GiB", settings.reuse.mode,
                 settings.pool.max_sessions, max_bytes / 2**30)
        if settings.disk.enabled and settings.disk.max_bytes > 0:
            disk = _disk_tier(settings, state_format(loaded, settings.engine.prefill_chunk, settings.reuse.mode),
                              pool, loaded.rope_keys)
    else:
        log.info("reuse pool disabled: every request runs cold")
    options = EngineOptions(settings.engine.prefill_chunk, threads, mode=settings.reuse.mode,
                            affinity=settings.affinity.enabled, longest_prefix=settings.affinity.longest_prefix,
                            compile=settings.engine.compile, tool_fallback=settings.tools.fallback,
                            max_batch=settings.server.max_batch, prefill_budget=settings.engine.prefill_budget or None,
                            batch_decode=settings.engine.batch_decode,
                            grammar_compile_s=settings.limits.grammar_compile_s,
                            adapt_threads=settings.model.threads == 0, speculate=settings.engine.speculate)
    return Engine(loaded, options, pool, disk, on_finished=on_finished)


def in_process(prefill_chunk: int, mode: str = "exact", max_sessions: int | None = None, affinity: bool = True,
               longest_prefix: bool = True, max_bytes: int = 2**33, threads: int = 0) -> Settings:
    """Settings for an engine a bench drives in process: no disk tier, eager one-row decode
    (one request at a time); `max_sessions` None: no reuse pool (every run cold). `threads` > 0
    fixes the thread count (model.threads): benches that compare arms pass it, since an
    adapting team probes one thread fewer now and then, at its own moments in each arm (an A/A
    run of `memrad bench interleaved` read two identical engines 1.25x apart that way)."""
    return Settings(model=ModelSettings(threads=threads),
                    engine=EngineSettings(prefill_chunk=prefill_chunk, compile="off"),
                    server=ServerSettings(max_batch=1),
                    pool=PoolSettings(enabled=max_sessions is not None, max_sessions=max_sessions or 0,
                                      max_bytes=max_bytes),
                    reuse=ReuseSettings(mode=mode), affinity=AffinitySettings(affinity, longest_prefix),
                    disk=DiskSettings(enabled=False))


def _disk_tier(settings: Settings, compat: dict[str, str], pool: ReusePool,
               ropes: dict[str, str] | None = None) -> DiskTier:
    """Index the disk tier's files (headers only) and keep new session ids clear of theirs."""
    directory = Path(settings.disk.dir).expanduser() if settings.disk.dir else sessions_dir()
    # Parked state holds prompts: its folder is the owner's only (memrad.private); a folder
    # the user named is created 0700 but not narrowed.
    private_dir(directory, tighten=not settings.disk.dir)
    disk = DiskTier(directory, settings.disk.max_bytes, compat, ropes)
    found = disk.index()
    pool.skip_ids_up_to(disk.session_ids())  # every model's files: new ids never name an existing file
    log.info("disk tier: %d parked sessions (%.1f MiB) in %s, up to %.1f GiB", len(found),
             disk.pool.bytes_parked / 2**20, directory, settings.disk.max_bytes / 2**30)
    return disk
