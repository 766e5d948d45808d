"""The bench clock: interleaved rounds, each technique sampled by the same rules, the order within
a round shuffled (no technique always right after the same one)."""

from __future__ import annotations

import time
from collections import Counter

from stagecache.runtime.bench.transfer import Clock, Sampling


def test_rounds_interleave_and_every_technique_gets_its_samples():
    calls: list[str] = []

    def fn(key: str, seconds: float):
        def run() -> None:
            calls.append(key)
            time.sleep(seconds)
        return run

    clock = Clock(False, Sampling(min_reps=5, max_reps=12, budget_s=60.0))
    ms = clock.interleaved_ms({"a": fn("a", 0.0), "b": fn("b", 0.0), "c": fn("c", 0.0)})
    assert Counter(calls) == {"a": 12, "b": 12, "c": 12}  # max_reps each (the budget is far off)
    rounds = [tuple(calls[i:i + 3]) for i in range(0, len(calls), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)  # one call of each per round
    assert len(set(rounds)) > 1  # the order changes between rounds
    follows = {(r[i], r[i + 1]) for r in rounds for i in range(2)}
    assert len(follows) == 6  # within a round, each ran right after each of the others (a cycle: 3)
    assert set(ms) == {"a", "b", "c"} and all(v >= 0 for v in ms.values())


def test_a_slow_technique_stops_early_while_the_others_go_on():
    calls: list[str] = []

    def fast() -> None:
        calls.append("fast")

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.02)

    clock = Clock(False, Sampling(min_reps=10, max_reps=20, budget_s=0.004))
    ms = clock.interleaved_ms({"fast": fast, "slow": slow})
    counts = Counter(calls)
    assert counts["slow"] == 3  # its first 3 calls took 4x the budget: it stops there
    assert counts["fast"] >= 10  # the other still gets its min_reps
    assert ms["slow"] >= 20.0 > ms["fast"]
