"""Damaging a copy of an embedded ``wowd.db`` as a failing disk or a torn write would: some pages
of one table overwritten with garbage, the file's header and the other tables left as they were."""

from __future__ import annotations

import random
import shutil
from contextlib import closing
from pathlib import Path

from wowd.stores.embedded.sqlite import sqlite3

__all__ = ["corrupt_table", "settled_copy", "table_leaves"]


def settled_copy(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with its write-ahead log checkpointed into the file first (a page
    written over in the copy is not shadowed by a newer one in a ``-wal`` file)."""
    with closing(sqlite3.connect(src)) as conn:
        busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0, f"{src}: the write-ahead log could not be checkpointed (another process writes)"
    shutil.copyfile(src, dst)
    return dst


def corrupt_table(path: Path, table: str, pages: int = 3, seed: int = 16) -> list[int]:
    """Overwrites the first ``pages`` leaf pages of ``table`` (the lowest keys: the first rows a
    reader meets) with random bytes; answers their numbers. Finds them by walking the table's
    b-tree (:func:`table_leaves`); the root page, the header (page 1) and every other table's
    pages are left intact."""
    with closing(sqlite3.connect(path)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
    leaves = table_leaves(path.read_bytes(), page_size, root)
    chosen = [n for n in leaves if n not in (1, root)][:pages]
    assert chosen, f"{path}: table {table} has no leaf page besides its root (too few rows to damage)"
    rng = random.Random(seed)
    with path.open("r+b") as f:
        for n in chosen:
            f.seek((n - 1) * page_size)
            f.write(rng.randbytes(page_size))
    return chosen


def table_leaves(data: bytes, page_size: int, root: int) -> list[int]:
    """The leaf pages of the table b-tree rooted at page ``root`` of the file ``data``, in key
    order, read as the file format lays them out (https://www.sqlite.org/fileformat2.html, "B-tree
    Pages": a header byte 0x05 for an interior page, 0x0D for a leaf; an interior page's cells
    start with their left child's number, its header ends with the right-most child's)."""
    leaves: list[int] = []

    def walk(n: int) -> None:
        base = (n - 1) * page_size
        header = base + (100 if n == 1 else 0)
        kind = data[header]
        if kind == 0x0D:
            leaves.append(n)
            return
        assert kind == 0x05, f"page {n} is not a page of a table b-tree (type {kind:#x})"
        cells = int.from_bytes(data[header + 3 : header + 5], "big")
        for i in range(cells):
            at = base + int.from_bytes(data[header + 12 + 2 * i : header + 14 + 2 * i], "big")
            walk(int.from_bytes(data[at : at + 4], "big"))
        walk(int.from_bytes(data[header + 8 : header + 12], "big"))

    walk(root)
    return leaves
