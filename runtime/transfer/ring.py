"""The id ring of the Triton engine: pinned entries a move's page ids are written into, taken in turn.

A entry is what a move's CUDA graph reads its ids from, so a entry may be written
again only once the last launch reading it ran; and a one-launch move's graph
records the entry's own start/end events, so the transfer those events time is
finished (its times read) before the entry's graph runs again.  The ring's state
-- next entry; per entry the event to wait for, whether its events time an
unfinished transfer, its end event -- lives in the words of a ``native.Context``,
which the compiled one-call move reads and writes too; this class is the Python
side of the same ring (several-launch moves, waiting, releasing).
"""

from __future__ import annotations

from typing import Any

from . import native

#: Smallest id-copy bucket (pages): a graph copies the ids of its bucket, not of the whole entry.
MIN_BUCKET = 16


def bucket(pages: int, cap: int) -> int:
    """The id-copy size (pages) a move of ``pages`` uses: the next power of two, within [MIN_BUCKET, cap]."""
    return min(cap, max(MIN_BUCKET, 1 << (pages - 1).bit_length()))


def bucket_sizes(cap: int) -> list[int]:
    """Every size ``bucket`` gives for a entry of ``cap`` pages, smallest first (the compiled move
    finds its bucket's index by the same doubling)."""
    sizes, size = [], MIN_BUCKET
    while True:
        sizes.append(min(size, cap))
        if size >= cap:
            return sizes
        size <<= 1


class IdRing:
    """A ring of ring entries (pinned host rows ``[n, device ids, host ids]``, device twins), taken in turn.

    The ring's state lives in the words of a ``native.Context`` (the compiled move reads and
    writes the same words): the next entry and, per entry, the event to wait for before the entry
    is written again (0: free), whether the entry's own start/end events time a transfer not yet
    finished, and the entry's end event.  A launch first copies its entry to the device twin
    (inside the same graph), so the kernel's many id reads stay on the device.
    """

    def __init__(self, entries: int, pages: int, anchor_addr: int, device: Any, words: Any):
        import torch

        self.pages, self.count, self.words = pages, entries, words
        self.host = torch.zeros((entries, 1 + 2 * pages), dtype=torch.int64, pin_memory=True)
        self.dev = torch.zeros_like(self.host, device=device)
        self.offsets = [(self.dev[k].data_ptr() - anchor_addr) // 8 for k in range(entries)]
        self.rows = list(self.host.numpy())  # each entry's numpy row (a view), made once
        # per entry: its guard (recorded after a piece of a several-launch move that reads it) and
        # its own timing events (recorded by the entry's graphs of one-launch moves)
        self.guards = [_recorded(torch.cuda.Event()) for _ in range(entries)]
        self.events = [(_recorded(torch.cuda.Event(enable_timing=True)), _recorded(torch.cuda.Event(enable_timing=True)))
                       for _ in range(entries)]
        self._by_handle = {e.cuda_event: e for e in self.guards + [e for pair in self.events for e in pair]}
        #: per entry, the unfinished transfer timed by the entry's own events (``synchronize()``d
        #: before the entry is taken again, which reads its times)
        self.owners: list[Any] = [None] * entries
        words[native.ENTRIES], words[native.CAP], words[native.NEXT] = entries, pages, 0
        words[native.ROWS], words[native.ROW_WORDS] = self.host.data_ptr(), 1 + 2 * pages
        for k, (_, end) in enumerate(self.events):
            base = native.RING + native.PER_ENTRY * k
            words[base + native.MARK] = words[base + native.OWNED] = 0
            words[base + native.END] = end.cuda_event

    def _word(self, entry: int, field: int) -> int:
        return native.RING + native.PER_ENTRY * entry + field

    def wait_free(self, entry: int) -> None:
        """Finish the transfer the entry's events time, and wait for the entry's last reader."""
        words = self.words
        if words[self._word(entry, native.OWNED)]:
            owner, self.owners[entry] = self.owners[entry], None
            if owner is not None:
                owner.synchronize()  # reads its times; ``release`` clears the flag
            words[self._word(entry, native.OWNED)] = 0
        mark = int(words[self._word(entry, native.MARK)])
        if mark:
            self._by_handle[mark].synchronize()  # backpressure: ``count`` transfers are queued
            words[self._word(entry, native.MARK)] = 0

    def take(self) -> int:
        """The next entry, free to be written (several-launch moves; one-launch moves take theirs in C)."""
        k = int(self.words[native.NEXT])
        self.wait_free(k)
        self.words[native.NEXT] = (k + 1) % self.count
        return k

    def fill(self, dev: Any, host: Any) -> int:
        """Write the ids (at most ``pages``) into the next free entry; returns the entry."""
        k = self.take()
        write_ids(self.rows[k], dev, host)
        return k

    def guard(self, entry: int) -> None:
        """Record the entry's own guard on the current stream (after a piece that reads it)."""
        self.guards[entry].record()
        self.words[self._word(entry, native.MARK)] = self.guards[entry].cuda_event

    def release(self, entry: int) -> None:
        """The transfer timed by the entry's events finished: the entry is free, and nothing waits on
        its end event any more (the entry's next move records it again)."""
        self.owners[entry] = None
        self.words[self._word(entry, native.OWNED)] = 0
        if self.words[self._word(entry, native.MARK)] == self.events[entry][1].cuda_event:
            self.words[self._word(entry, native.MARK)] = 0

    def upload(self, entry: int, pages: int) -> None:
        """Queue the copy of the entry's first ``pages`` ids to the device."""
        width = 1 + 2 * pages
        self.dev[entry, :width].copy_(self.host[entry, :width], non_blocking=True)


def write_ids(out: Any, dev: Any, host: Any) -> None:
    """The entry layout the kernel reads: ``[n, device ids..., host ids...]``."""
    n = dev.shape[0]
    out[0] = n
    out[1:1 + n] = dev
    out[1 + n:1 + 2 * n] = host


def _recorded(event: Any) -> Any:
    event.record()  # creates the CUDA event: its handle is what raw runtime calls and graphs use
    return event
