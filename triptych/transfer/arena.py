"""First-fit byte-range allocator over one pre-registered buffer (pure bookkeeping)."""

from __future__ import annotations

import bisect


class ByteArena:
    """Hands out aligned, non-overlapping [offset, offset+n) ranges of a buffer of `size` bytes.

    Ownership contract: `alloc` gives the caller a range until it calls `free(offset)` exactly once;
    freed neighbours coalesce. The arena never touches memory; the owner of the buffer maps offsets
    to addresses. Not thread-safe: the owning endpoint serializes calls.
    """

    def __init__(self, size: int, align: int = 64) -> None:
        if size < 0 or align < 1:
            raise ValueError(f"size={size} must be >= 0 and align={align} >= 1")
        self.size = size
        self.align = align
        self._holes: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length)
        self._taken: dict[int, int] = {}  # offset -> length

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._holes)

    @property
    def allocated(self) -> int:
        return len(self._taken)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of at least `nbytes`, or None when no hole is large enough."""
        length = max(self.align, -(-nbytes // self.align) * self.align)
        for i, (offset, hole) in enumerate(self._holes):
            if hole >= length:
                if hole == length:
                    del self._holes[i]
                else:
                    self._holes[i] = (offset + length, hole - length)
                self._taken[offset] = length
                return offset
        return None

    def free(self, offset: int) -> None:
        length = self._taken.pop(offset)  # KeyError: double free or foreign offset
        i = bisect.bisect(self._holes, (offset, length))
        self._holes.insert(i, (offset, length))
        if i + 1 < len(self._holes) and offset + length == self._holes[i + 1][0]:
            self._holes[i] = (offset, length + self._holes.pop(i + 1)[1])
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == offset:
            prev_off, prev_len = self._holes[i - 1]
            self._holes[i - 1] = (prev_off, prev_len + self._holes.pop(i)[1])
