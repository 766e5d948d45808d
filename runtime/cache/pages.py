"""Any request as the cache sees it: one 64-bit key per page, and which pages may hit or be kept.

The cache core never looks at token ids: a *chained* page key names a page together with its
whole prefix, so equal keys mean equal prefixes and the radix tree, both tiers, eviction and the
offline bounds all work on integers.  Token and Mooncake block requests differ only in where the
keys come from and in the hit and keep rules (docs/hicache.md, "Page keys", tables them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from .kv_writer import page_hashes


@dataclass(frozen=True, eq=False)
class PageView:
    """The page keys of one request and its hit/keep rules (docs/hicache.md, "Page keys")."""

    keys: np.ndarray  # uint64, one per page the request occupies while it runs
    input_len: int  # prompt tokens: what a lookup is accounted against
    output_len: int
    max_hit: int  # leading pages a lookup may match
    cacheable: int  # leading pages kept in the cache when the request finishes
    page_size: int
    tokens: np.ndarray | None = None  # prompt + answer ids (token requests only)

    @property
    def pages(self) -> int:
        return len(self.keys)

    def hit_tokens(self, pages: int) -> int:
        """Prompt tokens covered by a hit of ``pages`` leading pages."""
        return min(pages * self.page_size, self.input_len)


def page_view(request: Any, page_size: int, salt: int = 0) -> PageView:
    """The ``PageView`` of a token request, a block request, or anything with ``tokens``."""
    if isinstance(request, PageView):
        if request.page_size != page_size:
            raise ValueError(f"a PageView of page size {request.page_size} used at {page_size}")
        return request
    ids = getattr(request, "hash_ids", None)
    if ids is not None and request.block_tokens == page_size:
        keys = ids.astype(np.uint64) ^ np.uint64(salt) if salt else ids.view(np.uint64)
        n = len(keys)
        return PageView(keys, request.input_len, request.output_len, n, n, page_size)
    if ids is not None:
        prompt_len = request.input_len
        tokens = request.tokens()
    else:
        prompt = getattr(request, "input_ids", None)
        if prompt is None:  # a plain ``tokens`` request: all prompt, no answer
            prompt = request.tokens
        answer = getattr(request, "output_ids", ())
        prompt_len = len(prompt)
        tokens = np.concatenate([np.asarray(prompt, dtype=np.int64),
                                 np.asarray(answer, dtype=np.int64)])
    if prompt_len == 0:
        raise ConfigError("a request needs at least one prompt token")
    return PageView(page_hashes(tokens, page_size, salt), prompt_len, len(tokens) - prompt_len,
                    (prompt_len - 1) // page_size, len(tokens) // page_size, page_size, tokens)
