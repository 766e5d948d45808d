"""The chat-trace generator (determinism, multi-turn sharing) and the JSONL trace format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.traces.readers import (
    TraceError,
    WorkloadConfig,
    generate,
    load_trace,
    parse_trace,
    write_trace,
)

SMALL = WorkloadConfig(seed=3, requests=300, system_prompts=3, system_prompt_len=(64, 256),
                       user_len=(8, 64), assistant_len=(8, 64), turns=(2, 6))


def _key(reqs):
    return [(r.session, r.turn, r.input_ids.tolist(), r.output_ids.tolist(), r.arrival) for r in reqs]


def test_generator_is_deterministic_and_seeded():
    a, b = generate(SMALL), generate(SMALL)
    assert _key(a) == _key(b)
    other = generate(WorkloadConfig(**{**SMALL.__dict__, "seed": 4}))
    assert _key(other) != _key(a)
    assert len(a) == SMALL.requests
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)


def test_turns_extend_the_session_history_and_sessions_share_system_prompts():
    reqs = generate(SMALL)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    multi = [rs for rs in by_session.values() if len(rs) > 1]
    assert multi
    for rs in multi:
        assert [r.turn for r in rs] == list(range(len(rs)))  # in order, none missing
        for prev, nxt in zip(rs, rs[1:], strict=False):
            history = prev.tokens()
            assert nxt.input_len > len(history)
            assert np.array_equal(nxt.input_ids[:len(history)], history)
    firsts = {tuple(rs[0].input_ids[:64].tolist()) for rs in by_session.values()}
    assert len(firsts) <= SMALL.system_prompts < len(by_session)


def test_generator_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="user_len"):
        WorkloadConfig(user_len=(10, 5))
    with pytest.raises(ConfigError, match="requests"):
        WorkloadConfig(requests=0)


def test_jsonl_round_trip(tmp_path):
    reqs = generate(SMALL)[:50]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 50
    back = load_trace(path).requests
    assert [(r.session, r.turn, r.input_ids.tolist(), r.output_ids.tolist()) for r in back] == [
        (r.session, r.turn, r.input_ids.tolist(), r.output_ids.tolist()) for r in reqs]


def test_input_len_lines_share_the_previous_turn_as_prefix():
    lines = [
        '{"session": "a", "turn": 0, "input_len": 300, "output_len": 40}',
        '{"session": "b", "turn": 0, "input_len": 300, "output_len": 40}',
        '{"session": "a", "turn": 1, "input_len": 500, "output_len": 10}',
    ]
    a0, b0, a1 = parse_trace(lines).requests
    assert np.array_equal(a1.input_ids[:340], a0.tokens())
    assert not np.array_equal(a0.input_ids, b0.input_ids)
    again = parse_trace(lines).requests
    assert np.array_equal(again[2].input_ids, a1.input_ids)  # synthesis is deterministic


GOOD = [
    {"session": "s", "turn": 0, "input_ids": [1, 2, 3], "output_len": 2},
    {"session": "s", "turn": 1, "input_ids": [1, 2, 3, 4, 5, 6], "output_len": 2, "output_ids": [8, 9]},
    {"session": 7, "turn": 0, "input_len": 20, "output_len": 0, "arrival": 1.5},
]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "a line is list: accepted: a JSON object"),
    ('{"session": "x", "turn": 0, "output_len": 1}', "exactly one of 'input_ids' or 'input_len'"),
    ('{"session": "x", "turn": 0, "input_ids": [1], "input_len": 1, "output_len": 1}', "exactly one"),
    ('{"session": "x", "turn": 0, "input_ids": [1, -2], "output_len": 1}',
     "field 'input_ids[1]' = -2: accepted: a token id in [0, 2**31)"),
    ('{"session": "x", "turn": 0, "input_ids": [1, true], "output_len": 1}',
     "field 'input_ids[1]' = True: accepted"),
    ('{"session": "x", "turn": 0, "input_ids": [1, 2.5], "output_len": 1}', "'input_ids[1]' = 2.5"),
    ('{"session": "x", "turn": 0, "input_ids": [[1]], "output_len": 1}', "'input_ids[0]' = [1]"),
    ('{"session": "x", "turn": 0, "input_ids": [], "output_len": 1}', "accepted: a non-empty list"),
    ('{"session": "x", "turn": -1, "input_len": 5, "output_len": 1}',
     "field 'turn' = -1: accepted: an integer in [0, "),
    ('{"session": "x", "turn": 0, "input_len": 1000000000, "output_len": 1}',
     "field 'input_len' = 1000000000: accepted: an integer in [1, 2097152]"),
    ('{"session": "x", "turn": 0, "input_len": 5, "output_len": 2, "output_ids": [1]}',
     "field 'output_ids' has 1 ids: accepted: exactly 'output_len' = 2"),
    ('{"session": "x", "turn": 0, "input_len": 5, "output_len": 1, "tokens": 3}',
     "unknown field(s) 'tokens': accepted: session, turn"),
    ('{"session": "s", "turn": 1, "input_len": 5, "output_len": 1}', "already given on line 2"),
    ('{"turn": 0, "input_len": 5, "output_len": 1}', "missing required field 'session'"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_malformed_line_fails_before_replay_with_its_line_number(tmp_path, bad, message):
    lines = [json.dumps(GOOD[0]), json.dumps(GOOD[1]), bad, "", json.dumps(GOOD[2])]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    text = str(exc.value)
    assert f"{path}:3: " in text and message in text and "nothing replayed" in text
    assert "\n" not in text
    assert [e.line for e in exc.value.errors] == [3]
    # skip mode: the good lines are exactly what a file without the bad line gives
    skipped = load_trace(path, skip_bad=True)
    assert [e.line for e in skipped.errors] == [3]
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps(g) for g in GOOD) + "\n")
    want = load_trace(clean).requests
    assert [(r.session, r.turn, r.input_ids.tolist(), r.output_ids.tolist()) for r in skipped.requests] == [
        (r.session, r.turn, r.input_ids.tolist(), r.output_ids.tolist()) for r in want]
    assert [r.line for r in skipped.requests] == [1, 2, 5]


def test_every_bad_line_is_listed_and_empty_or_missing_files_are_clear(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("x\n" + json.dumps(GOOD[0]) + "\ny\n")
    with pytest.raises(TraceError, match="2 malformed line"):
        load_trace(path)
    path.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(path)
    with pytest.raises(ConfigError, match=r"trace '.*': cannot read: No such file or directory"):
        load_trace(tmp_path / "missing.jsonl")
