"""A generated trace in Mooncake's block format, shaped like a multi-turn conversation trace.

Why: sizing questions (``advise``, its benchmark) need a trace as large as the
public Mooncake conversation trace (about 12,000 requests, 180,000 distinct
blocks, 300,000 block lookups) on a machine that has none.  The generator makes
``BlockRequest`` s directly, so no token is ever hashed:

* a request either opens a conversation (one of a few shared system-prompt
  chains, then new blocks) or continues a live one, re-sending its whole
  history (every whole block so far) followed by new blocks (the last answer
  and the new message);
* the prompt ends in a partial block of its own (a new id), as a prompt cut at
  an arbitrary token does;
* at most ``live`` conversations are open at once (the oldest closes), and a
  conversation closes once it reaches ``max_blocks``.

Ids are prefix-aware by construction (a new block gets a new id), so the
trace passes the loader's prefix check when written and read back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .mooncake_trace import DEFAULT_BLOCK_TOKENS, BlockRequest


@dataclass(frozen=True)
class BlockWorkloadConfig:
    """Sizes of a generated block trace; ranges are ``(low, high)`` inclusive, in blocks."""

    seed: int = 0
    requests: int = 12_000
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    system_prompts: int = 8
    system_blocks: tuple[int, int] = (1, 6)
    first_blocks: tuple[int, int] = (2, 36)  # new blocks of a conversation's first prompt
    turn_blocks: tuple[int, int] = (1, 10)  # new whole blocks a later turn adds
    follow_up: float = 0.35  # share of requests that continue a live conversation
    live: int = 2000
    max_blocks: int = 160
    output_len: tuple[int, int] = (16, 700)
    gap_ms: float = 300.0  # mean gap between arrivals

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.system_prompts <= 0 or self.live <= 0:
            raise ConfigError("block workload: requests, system_prompts and live must be > 0")
        if not 0 <= self.follow_up <= 1:
            raise ConfigError(f"block workload: follow_up must be in [0, 1], got {self.follow_up}")
        for name in ("system_blocks", "first_blocks", "turn_blocks", "output_len"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ConfigError(f"block workload: {name} must be 0 <= low <= high, got ({lo}, {hi})")


def generate_blocks(cfg: BlockWorkloadConfig) -> list[BlockRequest]:
    """``cfg.requests`` block requests in arrival order; the same config gives the same trace."""
    rng = random.Random(cfg.seed)
    next_id = 0

    def new(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    prompts = [new(rng.randint(*cfg.system_blocks) or 1) for _ in range(cfg.system_prompts)]
    live: list[list[int]] = []
    out: list[BlockRequest] = []
    t = 0.0
    for index in range(cfg.requests):
        t += rng.expovariate(1.0 / cfg.gap_ms) if cfg.gap_ms else 0.0
        if live and rng.random() < cfg.follow_up:
            at = rng.randrange(len(live))
            whole = live[at] + new(rng.randint(*cfg.turn_blocks))
            live[at] = whole
            if len(whole) >= cfg.max_blocks:
                live.pop(at)
        else:
            whole = rng.choice(prompts) + new(rng.randint(*cfg.first_blocks))
            live.append(whole)
            if len(live) > cfg.live:
                live.pop(0)
        ids = whole + new(1)
        input_len = len(whole) * cfg.block_tokens + rng.randint(1, cfg.block_tokens)
        out.append(BlockRequest(np.asarray(ids, dtype=np.int64), input_len,
                                rng.randint(*cfg.output_len), cfg.block_tokens, t / 1000.0,
                                None, index))
    return out
