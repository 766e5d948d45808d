"""A self-written trace in Mooncake's format (not the public one): chats sharing system prompts.

Each request names its prompt by block ids, one per ``block`` tokens, prefix-aware:
a new conversation starts with one of a few system-prompt chains, a later turn
re-sends the conversation's history (its previous prompt's whole blocks, then
blocks of the answer and the new message) and ends in a partial block of its own.
"""

from __future__ import annotations

import json
import random


def sample_lines(requests: int = 400, seed: int = 0, block: int = 512, conversations: int = 60,
                 system_prompts: int = 3, max_blocks: int = 24) -> list[dict]:
    rng = random.Random(seed)
    next_id = 0

    def new(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    prompts = [new(rng.randint(1, 4)) for _ in range(system_prompts)]
    live: list[list[int]] = []  # per conversation: its whole blocks so far
    lines, t = [], 0
    for _ in range(requests):
        t += rng.choice((0, 0, 1000, 3000))
        if live and rng.random() < 0.65:
            whole = live[rng.randrange(len(live))]
        else:
            whole = list(rng.choice(prompts))
            live.append(whole)
            if len(live) > conversations:
                live.pop(0)
        whole += new(rng.randint(0, 4))  # the last answer and the new message, whole blocks
        ids = whole + new(1)  # the partial last block is this request's own
        if len(whole) >= max_blocks and whole in live:  # a long chat ends
            live.remove(whole)
        lines.append({"timestamp": t, "input_length": (len(ids) - 1) * block + rng.randint(1, block),
                      "output_length": rng.randint(1, 700), "hash_ids": ids})
    return lines


def write_sample(path, requests: int = 400, seed: int = 0, **kw) -> list[dict]:
    lines = sample_lines(requests, seed, **kw)
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return lines
