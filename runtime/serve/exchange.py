"""The stages' startup exchange: JSON sealed with the run's secret, never pickle.

torch's ``gather_object`` / ``broadcast_object_list`` unpickle whatever bytes arrive over
the data plane, and the data plane (gloo's TCP connections on ``--dist-host``) has no
authentication: a local process that got bytes into it could make a stage run code.  So the
startup exchange (inventories to rank 0, the verdict back, the last agreement verdicts) is
JSON in uint8 tensors, each message prefixed with an HMAC-SHA256 over it under the run's
secret (32 random bytes the serving parent hands every stage through its private process
start, never over a socket).  A message whose MAC does not verify is refused before a byte
of it is parsed; a valid one is plain data, checked again where it is used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from ..errors import StageCacheError

#: The largest message a stage takes (an inventory of a 4096-layer stage is ~60 KB).
MAX_MESSAGE_BYTES = 16 << 20
MAC_BYTES = hashlib.sha256().digest_size


class ExchangeRefused(StageCacheError):
    """A startup message did not come from this run's stages (or is not one)."""


def seal(secret: bytes, obj: Any) -> bytes:
    """``obj`` as JSON, prefixed with its MAC under ``secret``."""
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def unseal(secret: bytes, data: bytes, sender: str) -> Any:
    """The object a sealed message holds; ``ExchangeRefused`` unless its MAC verifies."""
    mac, payload = data[:MAC_BYTES], data[MAC_BYTES:]
    if len(data) < MAC_BYTES or not hmac.compare_digest(
            mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise ExchangeRefused(f"the startup message from {sender} failed the run's authentication "
                              "(not sent by this run's stages); refused unread")
    try:
        return json.loads(payload)
    except ValueError as exc:
        raise ExchangeRefused(f"the startup message from {sender} is not JSON: {exc}") from None


def _tensor(data: bytes, size: int, device: str) -> Any:
    import torch

    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def _checked_size(n: int, sender: str) -> int:
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise ExchangeRefused(f"{sender} announced a {n}-byte startup message; at most "
                              f"{MAX_MESSAGE_BYTES} are taken")
    return n


def all_gather_json(obj: Any, secret: bytes, world_size: int, device: str = "cpu",
                    group: Any = None) -> list[Any]:
    """Every stage's ``obj``, in rank order, on every stage (the inventories are small).

    ``group``: a ``torch.distributed`` process group (default: the world), e.g. sglang's
    PP CPU group."""
    import torch
    import torch.distributed as dist

    data = seal(secret, obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [_checked_size(int(s.item()), f"stage {r}") for r, s in enumerate(sizes)]
    width = max(lengths)
    out = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(out, _tensor(data, width, device), group=group)
    return [unseal(secret, bytes(o[:n].cpu().numpy()), f"stage {r}")
            for r, (o, n) in enumerate(zip(out, lengths, strict=True))]


def broadcast_json(obj: Any, secret: bytes, rank: int, src: int = 0, device: str = "cpu") -> Any:
    """``src``'s ``obj`` on every stage (``obj`` is ignored elsewhere)."""
    import torch
    import torch.distributed as dist

    data = seal(secret, obj) if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    n = _checked_size(int(size.item()), f"stage {src}")
    buf = _tensor(data, n, device)
    dist.broadcast(buf, src=src)
    return unseal(secret, bytes(buf.cpu().numpy()), f"stage {src}")
