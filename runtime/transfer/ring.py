"""The id ring of the Triton engine: pinned slots a move's page ids are written into, taken in turn.

A slot is what a move's CUDA graph reads its ids from, so a slot may be written
again only once the last launch reading it ran; and a one-launch move's graph
records the slot's own start/end events, so the transfer those events time is
finished (its times read) before the slot's graph runs again.  The ring's state
-- next slot; per slot the event to wait for, whether its events time an
unfinished transfer, its end event -- lives in the words of a ``native.Context``,
which the compiled one-call move reads and writes too; this class is the Python
side of the same ring (several-launch moves, waiting, releasing).
"""

from __future__ import annotations

from typing import Any

from . import native

#: Smallest id-copy bucket (pages): a graph copies the ids of its bucket, not of the whole slot.
MIN_BUCKET = 16


def bucket(pages: int, cap: int) -> int:
    """The id-copy size (pages) a move of ``pages`` uses: the next power of two, within [MIN_BUCKET, cap]."""
    return min(cap, max(MIN_BUCKET, 1 << (pages - 1).bit_length()))


def bucket_sizes(cap: int) -> list[int]:
    """Every size ``bucket`` gives for a slot of ``cap`` pages, smallest first (the compiled move
    finds its bucket's index by the same doubling)."""
    sizes, size = [], MIN_BUCKET
    while True:
        sizes.append(min(size, cap))
        if size >= cap:
            return sizes
        size <<= 1


class IdRing:
    """A ring of id slots (pinned host rows ``[n, device ids, host ids]``, device twins), taken in turn.

    The ring's state lives in the words of a ``native.Context`` (the compiled move reads and
    writes the same words): the next slot and, per slot, the event to wait for before the slot
    is written again (0: free), whether the slot's own start/end events time a transfer not yet
    finished, and the slot's end event.  With ``device_ids`` a launch first copies its slot to
    the device twin, so the kernel's many id reads stay on the device.
    """

    def __init__(self, slots: int, pages: int, anchor_addr: int, device: Any, device_ids: bool, words: Any):
        import torch

        self.pages, self.count, self.words = pages, slots, words
        self.host = torch.zeros((slots, 1 + 2 * pages), dtype=torch.int64, pin_memory=True)
        self.dev = torch.zeros_like(self.host, device=device) if device_ids else None
        read = self.dev if device_ids else self.host
        self.offsets = [(read[k].data_ptr() - anchor_addr) // 8 for k in range(slots)]
        self.rows = list(self.host.numpy())  # each slot's numpy row (a view), made once
        # per slot: its guard (recorded after a piece of a several-launch move that reads it) and
        # its own timing events (recorded by the slot's graphs of one-launch moves)
        self.guards = [_recorded(torch.cuda.Event()) for _ in range(slots)]
        self.events = [(_recorded(torch.cuda.Event(enable_timing=True)), _recorded(torch.cuda.Event(enable_timing=True)))
                       for _ in range(slots)]
        self._by_handle = {e.cuda_event: e for e in self.guards + [e for pair in self.events for e in pair]}
        #: per slot, the unfinished transfer timed by the slot's own events (``synchronize()``d
        #: before the slot is taken again, which reads its times)
        self.owners: list[Any] = [None] * slots
        words[native.SLOTS], words[native.CAP], words[native.NEXT] = slots, pages, 0
        words[native.ROWS], words[native.ROW_WORDS] = self.host.data_ptr(), 1 + 2 * pages
        for k, (_, end) in enumerate(self.events):
            base = native.RING + native.PER_SLOT * k
            words[base + native.MARK] = words[base + native.OWNED] = 0
            words[base + native.END] = end.cuda_event

    def _word(self, slot: int, field: int) -> int:
        return native.RING + native.PER_SLOT * slot + field

    def wait_free(self, slot: int) -> None:
        """Finish the transfer the slot's events time, and wait for the slot's last reader."""
        words = self.words
        if words[self._word(slot, native.OWNED)]:
            owner, self.owners[slot] = self.owners[slot], None
            if owner is not None:
                owner.synchronize()  # reads its times; ``release`` clears the flag
            words[self._word(slot, native.OWNED)] = 0
        mark = int(words[self._word(slot, native.MARK)])
        if mark:
            self._by_handle[mark].synchronize()  # backpressure: ``count`` transfers are queued
            words[self._word(slot, native.MARK)] = 0

    def take(self) -> int:
        """The next slot, free to be written (several-launch moves; one-launch moves take theirs in C)."""
        k = int(self.words[native.NEXT])
        self.wait_free(k)
        self.words[native.NEXT] = (k + 1) % self.count
        return k

    def fill(self, dev: Any, host: Any) -> int:
        """Write the ids (at most ``pages``) into the next free slot; returns the slot."""
        k = self.take()
        write_ids(self.rows[k], dev, host)
        return k

    def guard(self, slot: int) -> None:
        """Record the slot's own guard on the current stream (after a piece that reads it)."""
        self.guards[slot].record()
        self.words[self._word(slot, native.MARK)] = self.guards[slot].cuda_event

    def release(self, slot: int) -> None:
        """The transfer timed by the slot's events finished: the slot is free, and nothing waits on
        its end event any more (the slot's next move records it again)."""
        self.owners[slot] = None
        self.words[self._word(slot, native.OWNED)] = 0
        if self.words[self._word(slot, native.MARK)] == self.events[slot][1].cuda_event:
            self.words[self._word(slot, native.MARK)] = 0

    def upload(self, slot: int, pages: int) -> None:
        """Queue the copy of the slot's first ``pages`` ids to the device (a no-op for host ids)."""
        if self.dev is not None:
            width = 1 + 2 * pages
            self.dev[slot, :width].copy_(self.host[slot, :width], non_blocking=True)


def write_ids(out: Any, dev: Any, host: Any) -> None:
    """The slot layout the kernel reads: ``[n, device ids..., host ids...]``."""
    n = dev.shape[0]
    out[0] = n
    out[1:1 + n] = dev
    out[1 + n:1 + 2 * n] = host


def _recorded(event: Any) -> Any:
    event.record()  # creates the CUDA event: its handle is what raw runtime calls and graphs use
    return event
