"""What each of sglang's radix eviction policies hits on a trace, at a given cache size.

Why a replay and not a curve: only LRU has the inclusion property (``curves.py``), so each
(policy, size) is one run of the trace through a model of sglang 0.5.23's radix tree, the
full-KV part of ``UnifiedTreeCore``, reproduced down to its access clock so that priorities tie
exactly where sglang's tie (docs/advise.md, "Eviction policies", lists the rules).  The order
comes from sglang's own strategy objects where sglang is installed, else the versions below; a
test drives sglang's real tree with the same trace and compares every eviction call.  The host
tier is the same tree at the host's size: exact for LRU's page set only (stated in the advice).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..cache.pages import PageView
from ..errors import ConfigError

#: sglang 0.5.23's ``--radix-eviction-policy`` choices that rank a tree's leaves by use
#: (fifo, filo and mru exist too but are not in sglang's help text as serving policies).
POLICIES = ("lru", "lfu", "slru", "priority", "tlru")
#: T-LRU's configuration where none is given: sglang's own help example (sglang refuses its
#: class defaults 0 and 0 at startup: ``threshold`` must exceed ``next_prompt_estimate``).
TLRU_DEFAULT = {"threshold": 4096, "next_prompt_estimate": 512}
#: The keys each policy's class takes (sglang fails at startup on any other, naming it).
CONFIG_KEYS: Mapping[str, tuple[str, ...]] = {
    "lru": (), "lfu": (), "priority": (), "slru": ("protected_threshold",),
    "tlru": ("threshold", "next_prompt_estimate"),
}
#: One lookup stamps its ancestors this much older per level (sglang's ``cur_time -= 0.00001``).
ANCESTOR_STEP = 0.00001

Tier = Literal["device", "host"]


# -- stagecache's versions of sglang's strategies (mem_cache/evict_policy.py) ---------------------
class LRU:
    """Least recently used first."""

    def get_priority(self, node: Any) -> Any:
        return node.last_access_time


class LFU:
    """Fewest inserts through the node first, then least recently used."""

    def get_priority(self, node: Any) -> Any:
        return (node.hit_count, node.last_access_time)


class SLRU:
    """A probationary segment (fewer than ``protected_threshold`` inserts) before the protected
    one, least recently used first within each."""

    def __init__(self, protected_threshold: int = 2) -> None:
        self.protected_threshold = protected_threshold

    def get_priority(self, node: Any) -> Any:
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access_time)


class Priority:
    """Lower request priority first, then least recently used."""

    def get_priority(self, node: Any) -> Any:
        return (node.priority, node.last_access_time)


class TLRU:
    """Tail-optimised LRU: a node whose branch keeps enough cached prefix without it to hold the
    next prompt under the TTFT budget (``history + next_prompt_estimate - threshold`` tokens) is
    evicted first; then least recently used.  Token counts, as sglang's."""

    def __init__(self, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate

    def get_priority(self, node: Any) -> Any:
        budget = max(node._tlru_history_len + self.next_prompt_estimate - self.threshold, 0)
        safe = node._tlru_cached_prefix_len - len(node.key) >= budget
        return (-1 if safe else 0, node.last_access_time)


OWN_STRATEGIES: Mapping[str, Callable[..., Any]] = {
    "lru": LRU, "lfu": LFU, "slru": SLRU, "priority": Priority, "tlru": TLRU}


@dataclass(frozen=True)
class PolicySpec:
    """One policy with its ``--radix-eviction-policy-config`` (JSON object, as sglang takes it)."""

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if not self.config else f"{self.name} {json.dumps(dict(self.config), sort_keys=True)}"

    def flags(self) -> str:
        """The sglang flags that select it."""
        out = f"--radix-eviction-policy {self.name}"
        if self.config:
            out += f" --radix-eviction-policy-config '{json.dumps(dict(self.config), sort_keys=True)}'"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "config": dict(self.config),
                "flags": self.flags()}


def parse_policy_config(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``POLICY=JSON`` items (``--policy-config``), validated as sglang validates them at
    startup: a JSON object of the policy's own keys, non-negative integers; T-LRU's threshold
    above its next-prompt estimate.  One line per bad item (``ConfigError``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in POLICIES:
            raise ConfigError(f"--policy-config {item[:80]!r}: expected POLICY=JSON with POLICY one "
                              f"of {', '.join(POLICIES)}")
        if len(text) > 4096:
            raise ConfigError(f"--policy-config {name}: {len(text)} characters; at most 4096")
        try:
            value = json.loads(text)
        except ValueError:
            raise ConfigError(f"--policy-config {name}: {text[:80]!r} is not JSON; expected an "
                              "object such as '{\"protected_threshold\": 4}'") from None
        if not isinstance(value, dict):
            raise ConfigError(f"--policy-config {name}: expected a JSON object, got {text[:80]!r}")
        for key, v in value.items():
            if key not in CONFIG_KEYS[name]:
                accepted = ", ".join(CONFIG_KEYS[name]) or "none"
                raise ConfigError(f"--policy-config {name}: unknown key {key!r} (sglang fails at "
                                  f"startup on it); accepted: {accepted}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"--policy-config {name}: {key} must be a non-negative integer, "
                                  f"got {v!r}")
        out[name] = value
    tlru = {**TLRU_DEFAULT, **out.get("tlru", {})} if "tlru" in out else None
    if tlru is not None and tlru["threshold"] <= tlru["next_prompt_estimate"]:
        raise ConfigError(
            f"--policy-config tlru: threshold {tlru['threshold']} must exceed next_prompt_estimate "
            f"{tlru['next_prompt_estimate']} (sglang refuses it at startup: nothing is ever "
            "TEL-safe and T-LRU is LRU)")
    return out


def policy_specs(names: Sequence[str] | None, configs: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> list[PolicySpec]:
    """The policies to evaluate (default: all five), each with its config (T-LRU: sglang's
    help example unless given)."""
    configs = configs or {}
    chosen = list(dict.fromkeys(n.lower() for n in names)) if names else list(POLICIES)
    for n in chosen:
        if n not in POLICIES:
            raise ConfigError(f"--policies: unknown policy {n!r}; accepted: {', '.join(POLICIES)}")
    out = []
    for n in chosen:
        cfg = dict(configs.get(n, {}))
        if n == "tlru":
            cfg = {**TLRU_DEFAULT, **cfg}
        out.append(PolicySpec(n, cfg))
    return out


def own_strategy(spec: PolicySpec) -> Any:
    """stagecache's version of sglang's strategy for ``spec``."""
    return OWN_STRATEGIES[spec.name](**spec.config)


# -- the tree -------------------------------------------------------------------------------------
class _Key:
    """What ``len(node.key)`` is to sglang's strategies: the node's tokens."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Node:
    """One segment of the tree (the attributes sglang's strategies read keep sglang's names)."""

    __slots__ = ("keys", "children", "parent", "last_access_time", "creation_time", "hit_count",
                 "priority", "_tlru_cached_prefix_len", "_tlru_history_len", "tokens_per_page",
                 "id")

    def __init__(self, keys: list[int], parent: Node | None, clock: list[float],
                 tokens_per_page: int, priority: int, ident: int) -> None:
        self.keys = keys
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.last_access_time = clock[0]
        self.creation_time = clock[0] + 1
        clock[0] += 2
        self.hit_count = 0
        self.priority = priority
        self._tlru_cached_prefix_len = 0
        self._tlru_history_len = 0
        self.tokens_per_page = tokens_per_page
        self.id = ident

    @property
    def key(self) -> _Key:
        return _Key(len(self.keys) * self.tokens_per_page)

    def __lt__(self, other: Node) -> bool:  # heap ties, as sglang's node
        return self.last_access_time < other.last_access_time


@dataclass
class EvictionCall:
    """One eviction call: the request it made room for, pages asked for, and the evicted nodes'
    page keys, node by node in eviction order."""

    request: int
    asked: int
    evicted: list[list[int]]


@dataclass
class RunResult:
    """One (policy, size, tier) run: hit tokens and, if recorded, every eviction call."""

    hit_tokens: int
    hit_pages: list[int]
    evictions: list[EvictionCall] | None


class RadixModel:
    """sglang 0.5.23's full-KV radix tree under one strategy, one request at a time."""

    def __init__(self, strategy: Any, capacity: int, tokens_per_page: int = 1,
                 tlru: bool = False) -> None:
        self.strategy = strategy
        self.capacity = capacity
        self.tpp = tokens_per_page
        self.tlru = tlru
        self.clock = [0.0]
        self.next_id = 0
        self.root = self._new([], None, 0)
        self.root.priority = -(2 ** 63 - 1)
        self.size = 0  # pages held by the tree
        self.heap: list[tuple[Any, int, Node]] = []
        self.locked: Node | None = None

    def _new(self, keys: list[int], parent: Node | None, priority: int) -> Node:
        node = Node(keys, parent, self.clock, self.tpp, priority, self.next_id)
        self.next_id += 1
        return node

    def _tick(self) -> float:
        t = self.clock[0]
        self.clock[0] += 1
        return t

    # candidates ---------------------------------------------------------------------------------
    def _offer(self, node: Node) -> None:
        """Queue ``node`` at its current priority if it is an evictable leaf (stale entries are
        skipped when popped)."""
        if node is not self.root and not node.children and node is not self.locked:
            heapq.heappush(self.heap, (self.strategy.get_priority(node), node.id, node))

    def _valid(self, prio: Any, node: Node) -> bool:
        return (node.parent is not None and not node.children and node is not self.locked
                and node.parent.children.get(node.keys[0]) is node
                and self.strategy.get_priority(node) == prio)

    # tree operations ----------------------------------------------------------------------------
    def _split(self, child: Node, at: int) -> Node:
        parent = child.parent
        assert parent is not None
        new = self._new(child.keys[:at], parent, child.priority)
        new.hit_count = child.hit_count
        new.creation_time = child.creation_time
        if self.tlru:
            new._tlru_cached_prefix_len = parent._tlru_cached_prefix_len + at * self.tpp
            new._tlru_history_len = child._tlru_history_len
        child.keys = child.keys[at:]
        child.parent = new
        new.children[child.keys[0]] = child
        parent.children[new.keys[0]] = new
        child.last_access_time = self._tick()
        self._offer(child)
        return new

    @staticmethod
    def _common(a: list[int], b: list[int], off: int) -> int:
        n = min(len(a), len(b) - off)
        i = 0
        while i < n and a[i] == b[off + i]:
            i += 1
        return i

    def match(self, keys: list[int]) -> tuple[int, Node]:
        """sglang's ``match_prefix``: matched pages and the deepest matched node, splitting a
        segment the lookup stops inside; stamps the node and its ancestors."""
        node, off = self.root, 0
        children = node.children
        while off < len(keys) and keys[off] in children:
            child = children[keys[off]]
            n = self._common(child.keys, keys, off)
            off += n
            if n < len(child.keys):
                node = self._split(child, n)
                break
            node = child
            children = node.children
        t = self._tick()
        cur: Node | None = node
        while cur is not None:
            cur.last_access_time = t
            t -= ANCESTOR_STEP
            self._offer(cur)
            cur = cur.parent
        return off, node

    def insert(self, keys: list[int], priority: int = 0, count_hits: bool = True) -> tuple[int, Node]:
        """sglang's insert: pages already cached and the node the key ends on (the new leaf)."""
        self.root.last_access_time = self._tick()
        self.root.priority = max(self.root.priority, priority)
        node, off = self.root, 0
        if not keys:
            return 0, node
        while off < len(keys) and keys[off] in node.children:
            child = node.children[keys[off]]
            child.last_access_time = self._tick()
            n = self._common(child.keys, keys, off)
            if n < len(child.keys):
                child = self._split(child, n)
            child.priority = max(child.priority, priority)
            if count_hits:
                child.hit_count += 1
            self._offer(child)
            node = child
            off += n
        if off == len(keys):
            return off, node
        leaf = self._new(keys[off:], node, priority)
        if self.tlru:
            leaf._tlru_cached_prefix_len = node._tlru_cached_prefix_len + len(leaf.keys) * self.tpp
            leaf._tlru_history_len = max(leaf._tlru_history_len, leaf._tlru_cached_prefix_len)
            cur: Node | None = node
            while cur is not None and cur._tlru_history_len < leaf._tlru_cached_prefix_len:
                cur._tlru_history_len = leaf._tlru_cached_prefix_len
                self._offer(cur)
                cur = cur.parent
        node.children[leaf.keys[0]] = leaf
        self.size += len(leaf.keys)
        if count_hits:
            leaf.hit_count += 1
        self._offer(leaf)
        return off, leaf

    def evict(self, pages: int) -> list[list[int]]:
        """Whole leaves in the strategy's order until ``pages`` are freed (or none is left); the
        evicted nodes' keys."""
        out: list[list[int]] = []
        freed = 0
        heap = self.heap
        while freed < pages and heap:
            prio, _, node = heapq.heappop(heap)
            if not self._valid(prio, node):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.keys[0]]
            node.parent = None
            freed += len(node.keys)
            self.size -= len(node.keys)
            out.append(node.keys)
            self._offer(parent)
        if len(heap) > 8 * (self.next_id + 64):
            self._rebuild()
        return out

    def _rebuild(self) -> None:
        """Drop stale queue entries (the queue only grows otherwise)."""
        live = [(p, i, n) for p, i, n in self.heap if self._valid(p, n)]
        heapq.heapify(live)
        self.heap = live

    def lock(self, node: Node | None) -> None:
        """One request in flight: its matched node is not a candidate while it runs."""
        previous, self.locked = self.locked, node
        if previous is not None and previous is not node:
            self._offer(previous)


def run_policy(views: Sequence[PageView], strategy: Any, capacity: int, tier: Tier = "device",
               tokens_per_page: int = 1, tlru: bool = False, prompt_reinsert: bool = True,
               record: bool = False) -> RunResult:
    """Replay ``views`` through the model at ``capacity`` pages; hit tokens (and the eviction
    calls, with ``record``).  ``tokens_per_page`` scales T-LRU's token lengths: a page of a
    block trace is one block of ``block_tokens`` tokens."""
    tree = RadixModel(strategy, capacity, tokens_per_page, tlru)
    hits = 0
    hit_pages: list[int] = []
    calls: list[EvictionCall] | None = [] if record else None
    for i, v in enumerate(views):
        keys = v.keys.tolist()
        matched, node = tree.match(keys[:min(v.max_hit, len(keys))])
        hits += v.hit_tokens(matched)
        hit_pages.append(matched)
        tree.lock(node if node is not tree.root else None)
        if tier == "device":
            need = len(keys) - matched
        else:
            need = v.cacheable - _cached_run(tree, keys[:v.cacheable])
        shortfall = need - (capacity - tree.size)
        if shortfall > 0:
            evicted = tree.evict(shortfall)
            if calls is not None:
                calls.append(EvictionCall(i, shortfall, evicted))
        _, leaf = tree.insert(keys[:v.cacheable], 0)
        prompt = prompt_pages(v)
        if prompt_reinsert and 0 < prompt < v.cacheable:
            tree.insert(keys[:prompt], 1, count_hits=False)
        tree.lock(None)
        tree._offer(leaf)
    return RunResult(hits, hit_pages, calls)


def prompt_pages(view: PageView) -> int:
    """Whole pages of the prompt (what sglang's prompt-boundary re-insert keys): a token
    request's ``input_len // page_size``; a block request is all prompt (its kept blocks)."""
    return view.input_len // view.page_size if view.tokens is not None else view.cacheable


def _cached_run(tree: RadixModel, keys: list[int]) -> int:
    """Leading pages of ``keys`` the tree holds (read-only)."""
    node, off = tree.root, 0
    while off < len(keys) and keys[off] in node.children:
        child = node.children[keys[off]]
        n = RadixModel._common(child.keys, keys, off)
        off += n
        if n < len(child.keys):
            break
        node = child
    return off
