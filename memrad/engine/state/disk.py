"""The disk tier: parked state that survives `memrad stop`, a restart and a `kill -9`.

Sessions the memory cap evicts, and every parked session at `memrad stop`, are written here,
one safetensors file each (tensors, never pickle). At start the directory is indexed without
loading any state: a file's header names the session (tokens, text, checkpoints, ...), so
the planner sees disk sessions beside memory ones; a chosen one is loaded then.

    <dir>/s12.safetensors   tensors:  token_ids [N] int64
                                      final.<layer>.<attr>[.<key>]       state after N tokens
                                      at<p>.<layer>.<attr>[.<key>]       snapshot at p
                            metadata: "memra": JSON {format, compat, session, layers, checksum}

Files are written to a temp name and renamed, so a crash leaves a whole file or none (a
stray temp file is deleted at the next start). A file whose compatibility key (the model,
tokenizer, dtype, device, chunk and mode it was made under: `state_format`) differs
from the running engine's, that cannot be parsed (truncated), or whose checksum fails on
load is skipped with a log line and deleted, never loaded. The tier's records live in a
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
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from memrad.engine.state.kv import SlabLayer
from memrad.engine.state.snapshot import ParkedState, Snapshot
from memrad.engine.state.window import WindowLayer
from memrad.request import Identity
from memrad.reuse.pool import Namespace, ParkedSession, ReusePool

log = logging.getLogger("memrad.disk")

FORMAT = 1
SUFFIX = ".safetensors"
_SESSION_FIELDS = ("session_id", "text", "prompt_checkpoint", "checkpoints", "croppable", "exact_limit",
                   "fingerprint", "created_at", "last_used_at", "hits", "anchors")


class Unusable(Exception):
    """A file that must not be loaded: foreign, truncated or corrupt."""


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
            "device": loaded.device.type,
            "chunk": str(prefill_chunk), "mode": mode}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def _layer_entries(prefix: str, layer: Any, final: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """One layer as (JSON description, tensors). Raises Unusable for what it cannot store."""
    if isinstance(layer, SlabLayer):
        shared = final is not None and layer.slab is final.slab
        desc = {"kind": "SlabLayer", "length": layer.length, "shared": shared}
        if shared or not layer.is_initialized:
            return desc, {}
        return desc, {f"{prefix}.keys": layer.keys.detach().cpu().clone(),
                      f"{prefix}.values": layer.values.detach().cpu().clone()}
    if isinstance(layer, WindowLayer):
        desc = {"kind": "WindowLayer", "length": layer.cumulative_length, "initialized": layer.is_initialized}
        if not layer.is_initialized:
            return desc, {}
        return desc, {f"{prefix}.keys": layer.keys.detach().cpu().clone(),
                      f"{prefix}.values": layer.values.detach().cpu().clone()}
    desc: dict[str, Any] = {"kind": type(layer).__name__, "attrs": {}, "dicts": {}}
    tensors = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{name}"] = value.detach().cpu().clone()
        elif isinstance(value, dict):
            desc["dicts"][name] = {str(k): ("tensor" if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
            tensors.update({f"{prefix}.{name}.{k}": v.detach().cpu().clone()
                            for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif isinstance(value, (torch.device, torch.dtype)):
            continue  # restored from the engine's own cache layers
        elif value is None or isinstance(value, (bool, int, float, str)):
            desc["attrs"][name] = value
        else:
            raise Unusable(f"{type(layer).__name__}.{name} ({type(value).__name__}) has no file form")
    return desc, tensors


def _restore_layer(prefix: str, desc: dict, blank: Any, final: Any, tensors: dict[str, torch.Tensor],
                   device: torch.device) -> Any:
    if desc["kind"] == "SlabLayer":
        if desc["shared"]:
            return final.rewound(desc["length"]) if final is not None else blank
        if f"{prefix}.keys" in tensors:
            blank.update(tensors[f"{prefix}.keys"].to(device), tensors[f"{prefix}.values"].to(device))
        return blank
    if desc["kind"] == "WindowLayer" and isinstance(blank, WindowLayer):
        if desc["initialized"]:
            blank.restore(tensors[f"{prefix}.keys"].to(device), tensors[f"{prefix}.values"].to(device), desc["length"])
        return blank
    if type(blank).__name__ != desc["kind"]:
        raise Unusable(f"layer {prefix} was a {desc['kind']}, this model builds a {type(blank).__name__}")
    for name, value in desc["attrs"].items():
        setattr(blank, name, value)
    for name, entries in desc["dicts"].items():
        setattr(blank, name, {int(k) if k.lstrip("-").isdigit() else k:
                              (tensors[f"{prefix}.{name}.{k}"].to(device) if v == "tensor" else v)
                              for k, v in entries.items()})
    for key, t in tensors.items():
        head, _, name = key.rpartition(".")
        if head == prefix:
            setattr(blank, name, t.to(device))
    return blank


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, compat: dict[str, str]) -> None:
        self.directory = directory
        self.compat = compat
        self.pool = ReusePool(max_sessions=1 << 30, max_bytes=max_bytes)

    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}{SUFFIX}"

    # --- start: index without loading ------------------------------------------------------

    def index(self) -> list[ParkedSession]:
        """Register every usable file (least recently used first); delete the rest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stray in self.directory.glob("*.tmp"):
            stray.unlink(missing_ok=True)
        found = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                found.append(self._read_header(path))
            except Unusable as exc:
                self._discard(path, str(exc))
        for session in sorted(found, key=lambda s: s.last_used_at):
            for old in self.pool.park(session):
                self._discard(self._path(old.session_id), "over the disk tier's byte cap")
        return self.pool.sessions()

    def _read_header(self, path: Path) -> ParkedSession:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["memra"])
                token_ids = tuple(f.get_tensor("token_ids").tolist())
            compatible = meta.get("format") == FORMAT and meta.get("compat") == self.compat
            if compatible:
                s = meta["session"]
                return ParkedSession(
                    namespace=Namespace(self.compat["model"], s["cache_salt"]),
                    identity=Identity(*s["identity"]) if s["identity"] else None, token_ids=token_ids,
                    num_bytes=path.stat().st_size, on_disk=True, state=None,
                    **{k: tuple(v) if isinstance(v, list) else v for k, v in s.items() if k in _SESSION_FIELDS})
        except Exception as exc:  # safetensors raises its own types for truncated/garbled files
            raise Unusable(f"unreadable ({type(exc).__name__}: {exc})") from None
        raise Unusable(f"made under {meta.get('compat')}, this engine runs {self.compat}")

    # --- spill, load, forget ----------------------------------------------------------------

    def spill(self, session: ParkedSession, on_evicted: Callable[[ParkedSession], None]) -> bool:
        """Write `session` (a memory session) unless it is already on disk; True once it is."""
        if self.pool.get(session.session_id) is not None:
            return True
        if session.state is None:
            return False
        try:
            tensors, meta = self._encode(session)
        except Unusable as exc:
            log.info("not spilling %s: %s", session.session_id, exc)
            return False
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(session.session_id)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata={"memra": json.dumps(meta)})
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not write %s (%s): the session is dropped", path, exc)
            return False
        record = replace(session, state=None, num_bytes=path.stat().st_size, on_disk=True)
        if not self.pool.can_park(record.num_bytes):
            self._discard(path, "larger than the disk tier's byte cap")
            return False
        for old in self.pool.park(record):
            self._discard(self._path(old.session_id), "least recently used, over the disk tier's byte cap")
            on_evicted(old)
        return True

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
        meta = {"format": FORMAT, "compat": self.compat, "session": fields, "layers": layers,
                "checksum": _checksum(tensors)}
        return tensors, meta

    def load(self, session: ParkedSession, new_cache: Callable[[], Any]) -> ParkedState | None:
        """The state of a disk session, or None (file deleted, logged) if it fails its checks."""
        from safetensors import safe_open

        path = self._path(session.session_id)
        started = time.perf_counter()
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["memra"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            if _checksum(tensors) != meta["checksum"]:
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
            self.forget(session.session_id, f"skipped ({type(exc).__name__}: {exc})")
            return None
        log.info("loaded %s from disk (%d tokens, %d bytes) in %.2f s", session.session_id, session.num_tokens,
                 session.num_bytes, time.perf_counter() - started)
        final = snaps.pop("final")
        return ParkedState(final, {s.num_tokens: s for s in snaps.values()}, session.croppable)

    def forget(self, session_id: str, why: str = "replaced by its successor") -> None:
        """Drop a session from the tier and delete its file (no-op if not on disk)."""
        if self.pool.remove(session_id) is not None or self._path(session_id).exists():
            self._discard(self._path(session_id), why)

    def _discard(self, path: Path, why: str) -> None:
        self.pool.remove(path.name.removesuffix(SUFFIX))
        path.unlink(missing_ok=True)
        log.info("deleted %s: %s", path.name, why)
