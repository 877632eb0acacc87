"""Every request's block table, kept from step to step in one array.

A request that holds blocks owns a row; blocks are appended to it in place as the KV cache
manager hands them out, and the row goes back when the request's blocks are freed. A step then
takes its batch's tables with one indexing operation (``gather``) instead of rebuilding a list of
ids per request per step::

    row 0  [ 7  8  9 12  0  0 ...]   num_blocks[0] = 4
    row 1  [ 7  8 31  0  0  0 ...]   num_blocks[1] = 3
    row 2  (free)

The array grows (doubling) in both directions as needed; nothing has to be sized up front.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTables:
    def __init__(self, num_rows: int = 64, num_columns: int = 64) -> None:
        self.table = np.zeros((num_rows, num_columns), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # lowest row first
        # Bumped whenever a row is handed out or given back: while it stays the same, every
        # request keeps the row it had (``rows`` answers may be reused).
        self.version = 0

    def __len__(self) -> int:
        return len(self._row_of)

    def row(self, request_id: str) -> int:
        """The request's row; KeyError if it holds no blocks."""
        return self._row_of[request_id]

    def rows(self, request_ids: list[str]) -> np.ndarray:
        """The rows of these requests, in order; KeyError if one holds no blocks."""
        row_of = self._row_of
        return np.array([row_of[request_id] for request_id in request_ids], np.int64)

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Add blocks to the end of the request's table, giving it a row if it has none."""
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * self.table.shape[0])
            row = self._row_of[request_id] = self._free_rows.pop()
            self.version += 1
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(columns=max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def release(self, request_id: str) -> None:
        """Forget the request's table; its row is free for another. Unknown ids are ignored."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free_rows.append(row)
            self.version += 1

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table as a list (empty if it holds no blocks)."""
        row = self._row_of.get(request_id)
        if row is None:
            return []
        return self.table[row, : self.num_blocks[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The tables of ``rows``, in that order, as one [len(rows), longest] array; the ends of
        shorter tables hold stale ids, which no kernel reads (each sequence's length bounds it)."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def _grow(self, *, rows: int | None = None, columns: int | None = None) -> None:
        old_rows, old_columns = self.table.shape
        rows, columns = rows or old_rows, columns or old_columns
        table = np.zeros((rows, columns), dtype=np.int32)
        table[:old_rows, :old_columns] = self.table
        self.table = table
        if rows > old_rows:
            self.num_blocks = np.concatenate(
                [self.num_blocks, np.zeros(rows - old_rows, dtype=np.int32)]
            )
            self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows
