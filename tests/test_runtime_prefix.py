"""The prefix index finds the longest stored state a prompt continues, per principal only."""
from __future__ import annotations

from engine.runtime.memory import PrefixIndex, Snapshot, token_key


def test_longest_strict_prefix_per_principal():
    idx = PrefixIndex()
    sys_prompt = [1, 2, 3, 4]
    a = idx.add(Snapshot("alice", sys_prompt, "prefix"))
    b = idx.add(Snapshot("alice", sys_prompt + [5, 6, 7], "response"))
    idx.add(Snapshot("bob", sys_prompt + [5, 6, 7, 8], "response"))
    assert idx.longest_prefix("alice", sys_prompt + [5, 6, 7, 8, 9]) is b
    assert idx.longest_prefix("alice", sys_prompt + [5, 9]) is a   # a fork of the prefix
    assert idx.longest_prefix("alice", sys_prompt) is None        # strict: nothing to compute
    assert idx.longest_prefix("alice", [1, 2, 9]) is None
    assert idx.longest_prefix("carol", sys_prompt + [5, 6, 7, 8, 9]) is None
    # bob's longer state is never offered to alice
    assert idx.longest_prefix("alice", sys_prompt + [5, 6, 7, 8, 9]).principal == "alice"


def test_identical_states_are_deduplicated_and_removable():
    idx = PrefixIndex()
    s1 = idx.add(Snapshot("alice", [1, 2, 3], "response"))
    s2 = idx.add(Snapshot("alice", [1, 2, 3], "response"))
    assert s1 is s2 and len(idx) == 1
    assert s1.key == token_key("alice", [1, 2, 3]) != token_key("bob", [1, 2, 3])
    idx.remove(s1)
    assert len(idx) == 0 and idx.longest_prefix("alice", [1, 2, 3, 4]) is None
