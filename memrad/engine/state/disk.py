"""The disk tier: parked state that survives `memrad stop`, a restart and a `kill -9`.

Sessions the memory cap evicts, and every parked session at `memrad stop`, are written here,
one safetensors file each (tensors, never pickle). At start the directory is indexed without
loading any state: a file's header names the session (tokens, text, checkpoints, ...), so
the planner sees disk sessions beside memory ones; a chosen one is loaded then.

    <dir>/s12.safetensors   tensors:  token_ids [N] int64
                                      final.<layer>.<attr>[.<key>]       state after N tokens
                                      at<p>.<layer>.<attr>[.<key>]       snapshot at p
                            metadata: "memra": JSON {format, compat, session, layers, checksum}

Files are written to a temp name, fsynced and renamed, and the directory is fsynced after
the rename (memrad.durable), so a crash or a power cut leaves a whole file or none (a stray
temp file is deleted at the next start). A file whose compatibility key (the model,
tokenizer, dtype, rope, kernels, device, chunk and mode it was made under: `state_format`) differs
from the running engine's is kept for that engine; one that cannot be parsed (truncated),
fails a check or whose checksum fails on load is never loaded: it is set aside as
`<name>.bad`, logged with its name and why, and the start goes on (memrad.engine.state.sessionfile). The tier's records live in a
ReusePool of their own (its byte cap is the disk's, LRU), so the same prefix index serves
both tiers.

Attention rows a snapshot shares with the final state (SlabLayer views of one buffer) are
written once: a snapshot records only its row count. A WindowLayer (sliding window) is its
window's rows and its token count.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from memrad.engine.model.context import rope_key
from memrad.engine.model.formats import kernels
from memrad.engine.state.kv import SlabLayer
from memrad.engine.state.recurrent import HybridSlabLayer
from memrad.engine.threads import pin_to_one
from memrad.durable import fsync_dir, fsync_file
from memrad.faultpoint import kill_point
from memrad.private import FILE_MODE
from memrad.engine.state.sessionfile import (FORMAT, SET_ASIDE, Header, Unusable, claimed_id, encode_header,
                                             file_name, header_checksum, is_set_aside, is_stray_temp, read_header,
                                             read_int64s, session_id_of, set_aside, tensor_table, unlink_inside)
from memrad.engine.state.snapshot import ParkedState, Snapshot
from memrad.engine.state.window import WindowLayer
from memrad.request import Identity
from memrad.reuse.pool import NATIVE, Namespace, ParkedSession, ReusePool

log = logging.getLogger("memrad.disk")

_SESSION_FIELDS = ("text", "prompt_checkpoint", "checkpoints", "croppable", "exact_limit",
                   "fingerprint", "created_at", "last_used_at", "hits", "anchors")


def tokenizer_hash(tokenizer: Any) -> str:
    """Which tokenizer made the token ids: its vocabulary, merges and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return xxhash.xxh64_hexdigest((text + str(getattr(tokenizer, "chat_template", ""))).encode())


def state_format(loaded: Any, prefill_chunk: int, mode: str) -> dict[str, str]:
    """What parked state depends on besides its tokens: the tier's compatibility key. A file
    made under any other value is never loaded; a new setting that changes the state's bits
    is one more line here. `loaded`: a memrad.engine.model.loader.LoadedModel."""
    return {"model": loaded.model_id, "tokenizer": tokenizer_hash(loaded.tokenizer),
            "dtype": loaded.dtype_name, "weights": loaded.weights_name,
            "head": loaded.head,
            # fast mode parks decoded KV: torch's int4 kernel and memra's blocks (plain or interleaved) round apart
            "kernels": kernels(loaded.model, loaded.tensors.value),
            "rope": rope_key(loaded.model.config),  # a scaled context rotates every row differently
            "attention": loaded.attention.value,  # memra's prefill kernel and SDPA round differently
            "kv": loaded.kv.value,  # the rows' dtype (memrad.engine.model.kv_dtype)
            "products": loaded.products.choice.value,  # sliced (any count) or torch's (memrad.engine.model.products)
            "device": loaded.device.type,
            "chunk": str(prefill_chunk), "mode": mode}


def _checksum(tensors: dict[str, torch.Tensor], header: str) -> str:
    """Over the header's checksum, then every tensor's name, dtype, shape and bytes. Any dtype
    and shape: a 0-dim tensor (a sliding-window layer's window size) is flattened to one
    element before its bytes are viewed, an empty one hashes no bytes."""
    h = xxhash.xxh3_128(header.encode())
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(_bytes(t))
    return h.hexdigest()


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32", torch.int32: "I32",
                      torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _bytes(t: torch.Tensor):
    """A tensor's bytes, as safetensors stores them (row-major, little-endian, a 0-dim one as one element)."""
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().data


def write_session_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """`tensors` and memra's header, its checksums taken over the table they are written with."""
    table = tensor_table({name: (SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for name, t in tensors.items()})
    header = header_checksum(meta, table)
    meta["checksums"] = {"header": header, "tensors": _checksum(tensors, header)}
    with open(path, "wb") as handle:
        handle.write(encode_header(meta, table))
        for name in table:
            handle.write(_bytes(tensors[name]))


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy sharing no storage: safetensors refuses strided views and
    tensors that alias each other (two views of one buffer)."""
    return t.detach().to("cpu").contiguous().clone()


def _layer_entries(prefix: str, layer: Any, final: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """One layer as (JSON description, tensors). Raises Unusable for what it cannot store."""
    if isinstance(layer, SlabLayer):
        shared = final is not None and layer.slab is final.slab
        desc = {"kind": type(layer).__name__, "length": layer.length, "shared": shared}
        tensors = {}
        if isinstance(layer, HybridSlabLayer):  # its recurrent state beside the rows
            desc["linear"], tensors = _state_entries(prefix, layer)
        if shared or not layer.is_initialized:
            return desc, tensors
        return desc, {**tensors, f"{prefix}.keys": _owned(layer.keys), f"{prefix}.values": _owned(layer.values)}
    if isinstance(layer, WindowLayer):
        desc = {"kind": "WindowLayer", "length": layer.cumulative_length, "initialized": layer.is_initialized}
        if not layer.is_initialized:
            return desc, {}
        return desc, {f"{prefix}.keys": _owned(layer.keys),
                      f"{prefix}.values": _owned(layer.values)}
    desc: dict[str, Any] = {"kind": type(layer).__name__, "attrs": {}, "dicts": {}, "types": {}}
    tensors = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{name}"] = _owned(value)
        elif isinstance(value, dict):
            desc["dicts"][name] = {str(k): ("tensor" if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
            tensors.update({f"{prefix}.{name}.{k}": _owned(v)
                            for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif isinstance(value, torch.dtype):
            desc["types"][name] = str(value).removeprefix("torch.")
        elif isinstance(value, torch.device):
            desc["types"][name] = "device"  # the engine's own device (the compatibility key's)
        elif value is None or isinstance(value, (bool, int, float, str)):
            desc["attrs"][name] = value
        else:
            raise Unusable(f"{type(layer).__name__}.{name} ({type(value).__name__}) has no file form")
    return desc, tensors


def _restore_layer(prefix: str, desc: dict, blank: Any, final: Any, tensors: dict[str, torch.Tensor],
                   device: torch.device) -> Any:
    if desc["kind"] in ("SlabLayer", "HybridSlabLayer"):
        if type(blank).__name__ != desc["kind"]:
            raise Unusable(f"layer {prefix} was a {desc['kind']}, this model builds a {type(blank).__name__}")
        out = blank
        if desc["shared"]:
            out = final.rewound(desc["length"]) if final is not None else blank
        elif f"{prefix}.keys" in tensors:
            blank.update(tensors[f"{prefix}.keys"].to(device), tensors[f"{prefix}.values"].to(device))
        if "linear" in desc:
            _restore_state(prefix, desc["linear"], out, tensors, device)
        return out
    if desc["kind"] == "WindowLayer" and isinstance(blank, WindowLayer):
        if desc["initialized"]:
            blank.restore(tensors[f"{prefix}.keys"].to(device), tensors[f"{prefix}.values"].to(device), desc["length"])
        return blank
    if type(blank).__name__ != desc["kind"]:
        raise Unusable(f"layer {prefix} was a {desc['kind']}, this model builds a {type(blank).__name__}")
    for name, value in desc["attrs"].items():
        setattr(blank, name, value)
    for name, value in desc.get("types", {}).items():
        dtype = getattr(torch, value, None)
        if value != "device" and not isinstance(dtype, torch.dtype):
            raise Unusable(f"layer {prefix}.{name} names an unknown dtype {value!r}")
        setattr(blank, name, device if value == "device" else dtype)
    for name, entries in desc["dicts"].items():
        setattr(blank, name, {int(k) if k.lstrip("-").isdigit() else k:
                              (tensors[f"{prefix}.{name}.{k}"].to(device) if v == "tensor" else v)
                              for k, v in entries.items()})
    for key, t in tensors.items():
        head, _, name = key.rpartition(".")
        if head == prefix:
            setattr(blank, name, t.to(device))
    return blank


_STATE_DICTS = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                "has_previous_state", "conv_kernel_size")


def _state_entries(prefix: str, layer: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """A HybridSlabLayer's recurrent state as (JSON description, tensors)."""
    desc = {name: {str(k): "tensor" if isinstance(v, torch.Tensor) else v for k, v in getattr(layer, name).items()}
            for name in _STATE_DICTS}
    tensors = {f"{prefix}.{name}.{k}": _owned(v) for name in _STATE_DICTS
               for k, v in getattr(layer, name).items() if isinstance(v, torch.Tensor)}
    return desc, tensors


def _restore_state(prefix: str, desc: dict, layer: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, entries in desc.items():
        setattr(layer, name, {int(k): tensors[f"{prefix}.{name}.{k}"].to(device) if v == "tensor" else v
                              for k, v in entries.items()})
    state = next((t for t in layer.conv_states.values() if t is not None), None)
    layer.device, layer.dtype = device, None if state is None else state.dtype


@dataclass(frozen=True, slots=True)
class ForeignFile:
    """A usable file made under another compatibility key (another model, dtype, chunk, ...):
    kept for the engine that made it, never loaded here, counted against the byte cap."""

    session_id: str
    model: str
    num_bytes: int
    last_used_at: float


class DiskTier:
    """One directory shared by every model's engines; this one loads only its own files.
    `pool` holds the files of this engine's compatibility key (the planner reads it),
    `foreign` the rest; both count against `max_bytes`, least recently used out first.

    Evicted sessions are written on one writer thread (`spill_later`), off the engine
    thread's critical path; a session becomes visible to the planner once its file is whole.
    `_lock` guards the pool, `foreign` and the cap between that thread and the engine's.
    Parking uses it as a memrad.engine.parking.DiskLike (`NoDisk` when the tier is off)."""

    eviction = "spilling to disk"  # what becomes of a session the memory cap evicts

    def __init__(self, directory: Path, max_bytes: int, compat: dict[str, str],
                 ropes: dict[str, str] | None = None) -> None:
        """`ropes`: {scaling name: rope key} of the ropes this engine runs requests under
        (memrad.engine.model.rope.keys, as LoadedModel.rope_keys); None: `compat`'s rope alone,
        named "native" where it scales nothing (else no request's rope names it: such files are
        never resumed, and no session of another rope is ever written under its key). A file
        records the rope its session was computed under in its compat key (files older than
        per-conversation rope did too: the served rope, all they ran under) and loads as that
        rope's session."""
        self.directory = directory
        self.compat = compat
        self.ropes = ropes if ropes is not None else {_unscaled_name(compat.get("rope")): compat.get("rope")}
        self.claimed: set[str] = set()  # ids any entry here claims (a directory, a set-aside file, ...)
        self.max_bytes = max_bytes
        self.pool = ReusePool(max_sessions=1 << 30, max_bytes=max_bytes)
        self.foreign: dict[str, ForeignFile] = {}
        self._lock = threading.RLock()
        self._writer: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}

    def _path(self, session_id: str) -> Path:
        return self.directory / file_name(session_id)

    @property
    def bytes_used(self) -> int:
        return self.pool.bytes_parked + sum(f.num_bytes for f in self.foreign.values())

    def session_ids(self) -> list[str]:
        """Every session id something here claims: this engine's files, the others', and any
        other entry named after an id (new ids skip them all)."""
        with self._lock:
            return sorted({s.session_id for s in self.pool.sessions()} | set(self.foreign) | self.claimed)

    # --- start: index without loading ------------------------------------------------------

    def index(self) -> list[ParkedSession]:
        """Register every usable file (least recently used first) and return this engine's.
        Files of other compatibility keys are kept; truncated, corrupt or unknown-format ones
        are deleted; entries not named in memra's scheme are left alone. Never raises for a file."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        found: list[ParkedSession | ForeignFile] = []
        set_aside_before = 0
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            if is_stray_temp(entry.name):
                self._unlink(entry.name, "a spill that did not finish")
            elif is_set_aside(entry.name):
                set_aside_before += 1
            elif session_id_of(entry.name) is None:
                log.info("left alone %s in %s: not a memra session file", entry.name[:80], self.directory)
            else:
                try:
                    found.append(self._read(entry.name))
                except Unusable as exc:
                    self._discard(entry.name, exc)
                except Exception as exc:  # a check this code lacks: the file goes, the start goes on
                    self._discard(entry.name, Unusable(f"{type(exc).__name__}: {exc}"))
        # What stays claims its id, whatever it is (a directory `s10.safetensors`, a set-aside file).
        self.claimed = {c for c in map(claimed_id, os.listdir(self.directory)) if c is not None}
        if set_aside_before:
            log.info("disk tier: %d files set aside earlier (*%s) are kept in %s; `memrad cache clear` deletes them",
                     set_aside_before, SET_ASIDE, self.directory)
        for record in sorted(found, key=lambda r: r.last_used_at):
            self._make_room(record.num_bytes, lambda _: None)
            if isinstance(record, ForeignFile):
                self.foreign[record.session_id] = record
            else:
                self.pool.park(record)
        if self.foreign:
            models = sorted({f.model for f in self.foreign.values()})
            log.info("disk tier: kept %d sessions of other models or settings (%s), not loaded here",
                     len(self.foreign), ", ".join(models))
        return self.pool.sessions()

    def _read(self, name: str) -> ParkedSession | ForeignFile:
        """One file's record from its header (and token ids, if it is this engine's)."""
        header = read_header(self.directory, name, self.max_bytes)
        rope = self._rope_of(header.meta.get("compat"))
        if rope is None:
            return ForeignFile(header.session_id, header.model, header.num_bytes, header.last_used_at)
        token_ids = tuple(read_int64s(self.directory, header, "token_ids", limit=header.num_bytes // 8))
        return _session(header, token_ids, self.compat["model"], rope)

    def _rope_of(self, compat: Any) -> str | None:
        """The rope a file's session was computed under, if its compat key is this engine's
        under one of its ropes; else None (another model or setting: not loaded here)."""
        if not isinstance(compat, dict) or {k: v for k, v in compat.items() if k != "rope"} != {
                k: v for k, v in self.compat.items() if k != "rope"}:
            return None
        return next((name for name, key in self.ropes.items() if key == compat.get("rope")), None)

    def _make_room(self, num_bytes: int, on_evicted: Callable[[ParkedSession], None]) -> None:
        """Delete least recently used files, of any model, until `num_bytes` more fit the cap.
        The caller holds `_lock` (or runs alone, at start)."""
        while self.bytes_used + num_bytes > self.max_bytes:
            own = self.pool.sessions()[:1]
            other = min(self.foreign.values(), key=lambda f: f.last_used_at, default=None)
            if own and (other is None or own[0].last_used_at <= other.last_used_at):
                self.forget(own[0].session_id, "least recently used, over the disk tier's byte cap")
                on_evicted(own[0])
            elif other is not None:
                del self.foreign[other.session_id]
                self._unlink(file_name(other.session_id),
                             f"least recently used (a {other.model} session), over the disk tier's byte cap")
            else:
                return

    # --- spill, load, forget ----------------------------------------------------------------

    def spill_later(self, session: ParkedSession, on_evicted: Callable[[ParkedSession], None],
                    on_done: Callable[[ParkedSession, str | None], None]) -> None:
        """`spill` on the writer thread; `on_done(session, why)` is called there once it is on
        disk (why None) or lost. The memory pool has let go of `session`, so nothing else
        touches its buffers meanwhile."""
        if self._writer is None:
            # one intra-op thread: the engine's is the only team (memrad.engine.threads)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="memrad-spill", initializer=pin_to_one)

        def write() -> tuple[ParkedSession, str | None]:
            try:
                why = self.spill(session, on_evicted)
                on_done(session, why)
                return session, why
            finally:
                with self._lock:
                    self._pending.pop(session.session_id, None)

        with self._lock:
            self._pending[session.session_id] = self._writer.submit(write)

    def drain(self) -> list[tuple[ParkedSession, str]]:
        """Wait for every pending write; the sessions among them that could not be written."""
        with self._lock:
            futures = list(self._pending.values())
        done = [f.result() for f in futures]
        return [(session, why) for session, why in done if why is not None]

    def spill_all(self, sessions: list[ParkedSession],
                  on_evicted: Callable[[ParkedSession], None]) -> list[tuple[ParkedSession, str]]:
        """At `memrad stop`: wait for the pending writes, then write `sessions` in order (most
        recent last, so the LRU keeps the freshest). The sessions not written, and why."""
        unsaved = self.drain()
        written = 0
        for session in sessions:
            why = self.spill(session, on_evicted)
            if why is None:
                written += 1
            else:
                unsaved.append((session, why))
        log.info("wrote %d of %d parked sessions to %s", written, len(sessions), self.directory)
        return unsaved

    def spill(self, session: ParkedSession, on_evicted: Callable[[ParkedSession], None]) -> str | None:
        """Write `session` (a memory session) unless it is already on disk. None once it is on
        disk, else why it is not (logged here; the caller reports it). Never raises: a state
        the file format cannot hold must cost that one session, not the stop or the request."""
        with self._lock:
            if self.pool.get(session.session_id) is not None:
                return None
        if session.state is None:
            return "it holds no state"
        path = self._path(session.session_id)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            tensors, meta = self._encode(session)
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_session_file(tmp, tensors, meta)
            kill_point("spill-tmp")
            os.chmod(tmp, FILE_MODE)  # prompt tokens: the owner's only (safetensors makes 0600 today; not its promise)
            fsync_file(tmp)  # a power cut after the rename must not leave an empty file at its name
            kill_point("spill-rename")
            tmp.replace(path)
            kill_point("spill-renamed")
            fsync_dir(self.directory)  # the name itself, so a session said written survives a power cut
        except Exception as exc:  # Unusable, OSError (disk full), or a state this code cannot encode
            tmp.unlink(missing_ok=True)
            why = f"{type(exc).__name__}: {exc}"
            log.warning("could not write %s to the disk tier (%s): the session is lost", session.session_id, why)
            return why
        record = replace(session, state=None, drafts=None, num_bytes=path.stat().st_size, on_disk=True)
        if record.num_bytes > self.max_bytes:
            self._unlink(path.name, "larger than the disk tier's byte cap")
            return f"its {record.num_bytes} bytes exceed the disk tier's cap of {self.max_bytes}"
        with self._lock:
            self._make_room(record.num_bytes, on_evicted)
            self.pool.park(record)
        return None

    def _encode(self, session: ParkedSession) -> tuple[dict[str, torch.Tensor], dict]:
        state: ParkedState = session.state
        tensors = {"token_ids": torch.tensor(session.token_ids, dtype=torch.int64)}
        layers: dict[str, list] = {}
        finals = state.final.layers
        for tag, snap in [("final", state.final), *((f"at{p}", s) for p, s in sorted(state.snapshots.items()))]:
            layers[tag] = [snap.num_tokens]
            for i, layer in enumerate(snap.layers):
                desc, found = _layer_entries(f"{tag}.{i}", layer, None if tag == "final" else finals[i])
                layers[tag].append(desc)
                tensors.update(found)
        fields = {k: getattr(session, k) for k in _SESSION_FIELDS}
        fields.update(cache_salt=session.namespace.cache_salt,
                      identity=[session.identity.name, session.identity.source] if session.identity else None)
        if session.rope not in self.ropes:
            raise Unusable(f"it was computed under the {session.rope} rope, which this engine does not run")
        compat = dict(self.compat)
        if self.ropes[session.rope] is not None:  # None: a key without ropes (a test's)
            compat["rope"] = self.ropes[session.rope]  # the rope it was computed under
        return tensors, {"format": FORMAT, "compat": compat, "session": fields, "layers": layers}

    def load(self, session: ParkedSession, new_cache: Callable[[], Any]) -> ParkedState | None:
        """The state of a disk session, or None (file deleted, logged) if it fails its checks."""
        from safetensors import safe_open

        path = self._path(session.session_id)
        started = time.perf_counter()
        try:
            # The header again, checked before a tensor is read: the file may have changed.
            header = read_header(self.directory, path.name, self.max_bytes)
            meta = header.meta
            if self._rope_of(meta.get("compat")) != session.rope:
                raise Unusable("its compatibility key changed since the start")
            with safe_open(str(path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if _checksum(tensors, meta["checksums"]["header"]) != meta["checksums"]["tensors"]:
                raise Unusable("checksum mismatch")
            device = torch.device(self.compat["device"])
            snaps, final_layers = {}, None
            for tag, (num_tokens, *descs) in meta["layers"].items():
                blank = new_cache().layers
                layers = tuple(_restore_layer(f"{tag}.{i}", d, blank[i], None if final_layers is None
                                              else final_layers[i], tensors, device) for i, d in enumerate(descs))
                if tag == "final":
                    final_layers = layers
                snaps[tag] = Snapshot(num_tokens, layers)
        except Exception as exc:  # truncated, corrupt, or not ours: never load it
            with self._lock:
                self.pool.remove(session.session_id)
                self.claimed.add(session.session_id)
                self._discard(path.name, exc if isinstance(exc, Unusable)
                              else Unusable(f"skipped on load ({type(exc).__name__}: {exc})"))
            return None
        log.info("loaded %s from disk (%d tokens, %d bytes) in %.2f s", session.session_id, session.num_tokens,
                 session.num_bytes, time.perf_counter() - started)
        final = snaps.pop("final")
        return ParkedState(final, {s.num_tokens: s for s in snaps.values()}, session.croppable)

    def forget(self, session_id: str, why: str = "replaced by its successor") -> None:
        """Drop one of this engine's sessions and delete its file (no-op if not on disk)."""
        with self._lock:
            if self.pool.remove(session_id) is not None or self._path(session_id).exists():
                self._unlink(file_name(session_id), why)

    def _discard(self, name: str, problem: Unusable) -> None:
        """A file that must not be loaded: set aside as `<name>.bad` (corrupt, unsafe), or
        deleted (whole but unwanted here). Logged with its name either way."""
        if not problem.set_aside:
            return self._unlink(name, str(problem))
        left = set_aside(self.directory, name)
        if left is None:
            log.warning("set aside %s in %s as %s%s: %s; it is never loaded (`memrad cache clear` deletes it)",
                        name[:80], self.directory, name[:80], SET_ASIDE, problem)
        else:
            log.warning("skipped %s in %s (%s), not set aside: %s", name[:80], self.directory, problem, left)

    def _unlink(self, name: str, why: str) -> None:
        left = unlink_inside(self.directory, name)
        if left is None:
            log.info("deleted %s: %s", name, why)
        else:
            log.warning("skipped %s (%s), not deleted: %s", name[:80], why, left)


def _unscaled_name(key: str | None) -> str:
    """"native" for a rope key (canonical JSON) that scales nothing (or none at all), else a name
    no request runs under."""
    if key is None:
        return NATIVE
    try:
        params = json.loads(key)
    except ValueError:
        params = None
    scaled = not isinstance(params, dict) or params.get("rope_type", "default") != "default" or "factor" in params
    return f"unnamed scaled rope {key}" if scaled else NATIVE


def _session(header: Header, token_ids: tuple[int, ...], model: str, rope: str = NATIVE) -> ParkedSession:
    """A disk session's record from its checked header; raises Unusable for a field that is
    missing, of the wrong type, or breaks an invariant the pool relies on."""
    s = header.meta.get("session")
    try:
        ints = lambda key: tuple(int(x) for x in s[key])
        identity = s["identity"]
        session = ParkedSession(
            session_id=header.session_id, namespace=Namespace(model, s["cache_salt"]),
            identity=Identity(str(identity[0]), identity[1]) if identity else None, token_ids=token_ids,
            text=str(s["text"]), prompt_checkpoint=int(s["prompt_checkpoint"]), checkpoints=ints("checkpoints"),
            croppable=bool(s["croppable"]), exact_limit=int(s["exact_limit"]), fingerprint=ints("fingerprint"),
            num_bytes=header.num_bytes, created_at=float(s["created_at"]), last_used_at=float(s["last_used_at"]),
            hits=int(s["hits"]), anchors=ints("anchors"), state=None, on_disk=True, rope=rope)
    except (KeyError, TypeError, ValueError, IndexError):
        raise Unusable("garbled session fields") from None
    if s["cache_salt"] is not None and not isinstance(s["cache_salt"], str):
        raise Unusable("garbled session fields")
    n = session.num_tokens
    if not (0 < session.prompt_checkpoint <= n and all(0 < c <= n for c in session.checkpoints)
            and all(0 < a <= n for a in session.anchors) and 0 <= session.exact_limit):
        raise Unusable(f"checkpoints outside its {n} tokens")
    if not session.croppable and n not in session.checkpoints:
        raise Unusable("no checkpoint at its final state")
    return session
