"""One disk-tier file, read without trusting it: its name, its header, its checks.

No torch here (the CLI's `memrad status` and `memrad cache clear` read headers with the
standard library): a file is a safetensors file, and its header is parsed by hand, so a file
is judged before any tensor is read:

    <dir>/s12.safetensors    [8 bytes: n, little-endian] [n bytes: JSON header] [tensor bytes]
                             header["__metadata__"]["memra"]: JSON {format, compat, session,
                                                               layers, checksums}

Trust rules (a file may come from anyone who can write the directory):
  - The session id is the file's name, in memra's own scheme (`s<N>`); nothing in a file's
    contents is ever used as a path. Only names in that scheme are memra's files: anything
    else in the directory is left alone.
  - A file must be a regular file (not a link) directly inside the directory, its size
    within the tier's byte cap, its header small and exactly covering the file (truncation),
    and its header checksum right, before its model is looked at; only then is anything
    else read. The header checksum covers the whole header: memra's metadata and the tensor
    table (names, dtypes, shapes, offsets), so no field that says where bytes lie is used
    before it is checked; the table must then tile the data exactly. The tensor checksum
    (seeded with the header's) is checked on load.
  - A file that fails a check is set aside, not deleted (renamed `<name>.bad`, logged with
    its name and why): it may be someone's evidence, and it never stops a start. A file
    that is whole but unwanted here (over the byte cap, another format) is deleted.

memra writes the file itself (`encode_header` + the tensors' bytes in table order), so the
table exists before the checksum is taken; safetensors reads it like its own files.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
import xxhash

FORMAT = 3  # 1: checksum over tensors only, session id in the header; 2: tensor table outside the checksum
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 64 * 2**20  # a 32k-token session's text and token table are well under 1 MiB
_NAME = re.compile(r"s[1-9][0-9]{0,17}")
_STRAY = re.compile(r"s[1-9][0-9]{0,17}\.safetensors\.[0-9]+\.tmp")
_CLAIM = re.compile(r"(s[1-9][0-9]{0,17})(\..*)?", re.DOTALL)  # any entry that starts with an id
SET_ASIDE = ".bad"
# safetensors' dtype names and their element sizes
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2,
               "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class Unusable(Exception):
    """A file that must not be loaded: truncated, corrupt or unsafe (set aside), or whole but
    unwanted here (`set_aside` False: deleted)."""

    set_aside = True


class Unwanted(Unusable):
    """A whole file this engine will not keep: over the byte cap, or of another format."""

    set_aside = False


def is_session_id(session_id: str) -> bool:
    return _NAME.fullmatch(session_id) is not None


def file_name(session_id: str) -> str:
    """The file of a session id memra made; anything else is refused (never a path)."""
    if not is_session_id(session_id):
        raise ValueError(f"not a memra session id: {session_id[:40]!r}")
    return session_id + SUFFIX


def session_id_of(name: str) -> str | None:
    """The session id a directory entry's name stands for, or None (not memra's file)."""
    stem = name.removesuffix(SUFFIX)
    return stem if name.endswith(SUFFIX) and is_session_id(stem) else None


def claimed_id(name: str) -> str | None:
    """The session id any directory entry's name claims (`s10`, `s10.safetensors`, a directory
    `s10.safetensors`, a set-aside `s10.safetensors.bad`): new ids skip every one of them."""
    match = _CLAIM.fullmatch(name)
    return match.group(1) if match else None


def is_set_aside(name: str) -> bool:
    return name.endswith(SUFFIX + SET_ASIDE) and session_id_of(name.removesuffix(SET_ASIDE)) is not None


def set_aside(directory: Path, name: str) -> str | None:
    """Rename the file `name` inside `directory` to `<name>.bad` (replacing an older one; a link
    is renamed, never followed). None once done, else why it stays (a directory, no permission)."""
    return _act_inside(directory, name, lambda path: os.replace(path, directory / (name + SET_ASIDE)))


def is_stray_temp(name: str) -> bool:
    """A temp file a spill left when it was killed before its rename."""
    return _STRAY.fullmatch(name) is not None


def inside(directory: Path, path: Path) -> bool:
    """Whether `path` names an entry directly inside `directory` (resolved, links not followed)."""
    return path.parent.resolve() == directory.resolve() and path.name not in ("", ".", "..")


def unlink_inside(directory: Path, name: str) -> str | None:
    """Delete the file or link `name` directly inside `directory` (a link itself, never its
    target). None once it is gone, else why it was left (outside, a directory, no permission)."""
    return _act_inside(directory, name, Path.unlink)


def _act_inside(directory: Path, name: str, act) -> str | None:
    """`act(path)` on the file or link `name` directly inside `directory`, never a directory.
    None once done (or already gone), else why not."""
    path = directory / name
    if "/" in name or not inside(directory, path):
        return f"not inside {directory}"
    try:
        if stat.S_ISDIR(path.lstat().st_mode):
            return "a directory"
        act(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror
    return None


def header_checksum(meta: dict, table: dict) -> str:
    """Over the whole header but the checksums themselves: memra's metadata and the tensor
    table (canonical JSON)."""
    body = {"memra": {k: v for k, v in meta.items() if k != "checksums"}, "tensors": table}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def tensor_table(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
    """The safetensors table for `tensors` (name -> (dtype, shape)), laid out as safetensors
    lays out its own: widest elements first, then by name, so every tensor stays aligned."""
    table, offset = {}, 0
    for name in sorted(tensors, key=lambda name: (-DTYPE_BYTES[tensors[name][0]], name)):
        dtype, shape = tensors[name]
        num_bytes = DTYPE_BYTES[dtype] * math.prod(shape)
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    return table


def encode_header(meta: dict, table: dict) -> bytes:
    """The file's first bytes: the header's length, then the header (padded to 8 bytes with
    spaces, as safetensors pads). The tensors' bytes follow in `table`'s order."""
    header = json.dumps({"__metadata__": {"memra": json.dumps(meta)}, **table}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def _check_table(table: dict) -> int:
    """The data's length if the table tiles it exactly (known dtypes, whole shapes, each
    tensor where the last one ended); raises Unusable."""
    spans = []
    for name, entry in table.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES:
            raise Unusable(f"garbled tensor table (tensor {name[:80]!r})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and offsets[1] - offsets[0] == DTYPE_BYTES[entry["dtype"]] * math.prod(shape)):
            raise Unusable(f"garbled tensor table (tensor {name[:80]!r})")
        spans.append(offsets)
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise Unusable("garbled tensor table (tensors overlap or leave gaps)")
        end = stop
    return end


@dataclass(frozen=True, slots=True)
class Header:
    """What a file says about itself, checked (checksum, size, shape) but not yet its tensors."""

    session_id: str   # from the file's name
    meta: dict         # the memra metadata: format, compat, session, layers, checksums
    tensors: dict      # safetensors' table: name -> {dtype, shape, data_offsets}
    data_start: int    # byte offset of the tensor data
    num_bytes: int     # the file's size

    @property
    def model(self) -> str:
        return str(self.meta.get("compat", {}).get("model", "?"))

    @property
    def last_used_at(self) -> float:
        value = self.meta.get("session", {}).get("last_used_at", 0.0)
        return float(value) if isinstance(value, (int, float)) else 0.0


def read_header(directory: Path, name: str, max_bytes: int) -> Header:
    """Check the file `name` in `directory` and parse its header; raises Unusable."""
    session_id = session_id_of(name)
    if session_id is None:
        raise Unusable("not a memra session file name")
    path = directory / name
    try:
        st = path.lstat()
    except OSError as exc:
        raise Unusable(f"cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise Unusable("not a regular file")
    if not inside(directory, path):
        raise Unusable("not inside the sessions directory")
    if st.st_size > max_bytes:
        raise Unwanted(f"{st.st_size} bytes: larger than the disk tier's byte cap of {max_bytes}")
    try:  # O_NONBLOCK: a FIFO swapped in after the lstat must not hang the start
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise Unusable(f"cannot open ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Unusable("not a regular file")
    with os.fdopen(fd, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise Unusable("truncated (no header)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            raise Unusable(f"truncated or not safetensors (a {n}-byte header in a {st.st_size}-byte file)")
        raw = handle.read(n)
    try:
        table = json.loads(raw)
        meta = json.loads(table.pop("__metadata__")["memra"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise Unusable("not a memra safetensors file (no readable header)") from None
    if not isinstance(meta, dict) or type(meta.get("format")) is not int:
        raise Unusable("not a memra safetensors file (no format in its header)")
    if meta["format"] != FORMAT:
        raise Unwanted(f"format {meta['format']} (this memrad reads format {FORMAT})")
    checksums = meta.get("checksums")
    try:
        right = isinstance(checksums, dict) and checksums.get("header") == header_checksum(meta, table)
    except (TypeError, ValueError, RecursionError):  # keys json cannot sort
        right = False
    if not right:
        raise Unusable("header checksum mismatch")
    end = _check_table(table)
    if 8 + n + end != st.st_size:
        raise Unusable(f"truncated ({st.st_size} bytes, the header describes {8 + n + end})")
    return Header(session_id, meta, table, 8 + n, st.st_size)


def read_int64s(directory: Path, header: Header, tensor: str, limit: int) -> list[int]:
    """One 1-D int64 tensor (the token ids) read from its offsets alone; raises Unusable."""
    entry = header.tensors.get(tensor)  # checked by read_header: known dtype, whole shape, in the data
    if not isinstance(entry, dict) or entry["dtype"] != "I64" or len(entry["shape"]) != 1:
        raise Unusable(f"no 1-D int64 tensor {tensor!r}")
    start, end = entry["data_offsets"]
    if end - start > 8 * limit:
        raise Unusable(f"tensor {tensor!r} has a wrong size")
    with open(directory / file_name(header.session_id), "rb") as handle:
        handle.seek(header.data_start + start)
        data = handle.read(end - start)
    if len(data) != end - start:
        raise Unusable("truncated")
    return [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One entry of `scan`: a session file, or why it is not usable."""

    session_id: str
    model: str | None   # None: unusable
    num_bytes: int
    problem: str | None = None


def scan(directory: Path, max_bytes: int = 2**62) -> list[FileInfo]:
    """Every memra session file in `directory` with its model (headers only; mutates nothing)."""
    found = []
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except OSError:
        return []
    for name in names:
        session_id = session_id_of(name)
        if session_id is None:
            continue
        try:
            header = read_header(directory, name, max_bytes)
            found.append(FileInfo(session_id, header.model, header.num_bytes))
        except Unusable as exc:
            try:
                size = (directory / name).lstat().st_size
            except OSError:
                continue  # gone meanwhile
            found.append(FileInfo(session_id, None, size, str(exc)))
    return found


def clear(directory: Path, model: str | None = None) -> list[FileInfo]:
    """`memrad cache clear`: delete the session files of `model` (None: every one, unusable
    ones, set-aside ones and stray temp files too); returns what was deleted (set-aside and
    temp files are not listed). Other entries are left alone."""
    gone = [f for f in scan(directory) if model is None or f.model == model]
    for f in gone:
        unlink_inside(directory, file_name(f.session_id))
    if model is None:
        for entry in os.scandir(directory) if directory.is_dir() else ():
            if is_stray_temp(entry.name) or is_set_aside(entry.name):
                unlink_inside(directory, entry.name)
    return gone
