"""Damaging a copy of an embedded ``wowd.db`` as a failing disk or a torn write would: some pages
of one table overwritten with garbage, the file's header and the other tables left as they were."""

from __future__ import annotations

import random
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

__all__ = ["corrupt_table", "settled_copy"]


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
    reader meets) with random bytes; answers their numbers. Finds them with SQLite's ``dbstat``
    table; the root page, the header (page 1) and every other table's pages are left intact."""
    with closing(sqlite3.connect(path)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchone()
        leaves = [
            n
            for (n,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY path", (table,)
            ).fetchall()
        ]
    chosen = [n for n in leaves if n not in (1, root)][:pages]
    assert chosen, f"{path}: table {table} has no leaf page besides its root (too few rows to damage)"
    rng = random.Random(seed)
    with path.open("r+b") as f:
        for n in chosen:
            f.seek((n - 1) * page_size)
            f.write(rng.randbytes(page_size))
    return chosen
