"""Files published by a rename survive a power cut: whole under their final name, or absent.

A rename is atomic against a crash of the process, not against a crash of the machine: the
kernel may write the new directory entry to disk before the file's data, so after a power
cut the final name can hold an empty or partial file. `publish` flushes the staged data
first, then renames, then flushes the directory that holds the new name:

    write staging -> fsync(staging: each file, each folder inside) -> rename -> fsync(parent)

Cost: one fsync per file (the data goes to disk; a spill of a 2k-token session measured in
docs/BENCHMARKS.md) and one per directory (metadata only).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush one file's data (and its size) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries: the names created, renamed or deleted in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """A file, or a folder with every file and folder inside it (bottom up)."""
    path = Path(path)
    if not path.is_dir():
        fsync_file(path)
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


def publish(staging: Path, final: Path) -> None:
    """Rename `staging` (a file, or a folder of files) over `final`, durably: its data is on
    disk before the name appears, and the name is on disk when this returns."""
    fsync_tree(staging)
    os.replace(staging, final)
    fsync_dir(Path(final).parent)
