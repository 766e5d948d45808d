"""sglang's own eviction strategies, where sglang is installed (``advise --policies``).

Why: ``advise --policies`` ranks a tree's leaves by a strategy's ``get_priority(node)``;
where sglang 0.5.23 is importable the ranking should be sglang's own code, not a copy, so a
release that changes a policy changes the advice.  ``sizing/policies.py`` keeps
stagecache's versions for machines without sglang; a test drives sglang's real tree with both
and compares every eviction.  Only ``mem_cache.utils.get_eviction_strategy`` (sglang's own
factory, which also checks the config's keys) is imported, lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..sizing.policies import PolicySpec


def sglang_factory() -> Callable[[PolicySpec], Any] | None:
    """``spec -> sglang's strategy object``, or ``None`` where sglang cannot be imported."""
    try:
        from sglang.srt.mem_cache.utils import get_eviction_strategy
    except Exception:  # noqa: BLE001 - any import failure means "use stagecache's versions"
        return None

    def build(spec: PolicySpec) -> Any:
        try:
            return get_eviction_strategy(spec.name, dict(spec.config) or None)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--policy-config {spec.name}: sglang refuses it: {exc}") from None

    return build


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return None
