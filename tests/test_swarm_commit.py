"""The swarm's commit as pure functions: the ack intersection and which state is the group's. No peers, no
hivemind daemon: what each member holds and announces is written out by hand."""

from __future__ import annotations

import itertools
import struct

from diloco.comm.hivemind.commit import agree, read_acks, resync_sources
from diloco.comm.hivemind.framing import pack


def test_members_that_all_hold_every_payload_agree_on_all_of_them():
    everyone = {"a", "b", "c", "d"}
    got = agree("a", everyone, {p: set(everyone) for p in "bcd"})
    assert got.members == frozenset(everyone) and not got.narrowed and not got.none_in_common


def test_a_payload_one_member_lacks_is_left_out_for_everyone():
    # c never got d's payload: nobody counts d's, so every member averages the same three
    held = {"b": {"a", "b", "c", "d"}, "c": {"a", "b", "c"}, "d": {"a", "b", "c", "d"}}
    assert agree("a", {"a", "b", "c", "d"}, held).members == frozenset("abc")


def test_a_member_that_did_not_commit_or_holds_not_its_own_payload_is_left_out():
    # d delivered its payload but sent no commit; c's commit does not hold c's own payload (not a commit)
    held = {"b": {"a", "b", "c", "d"}, "c": {"a", "b", "d"}}
    assert agree("a", {"a", "b", "c", "d"}, held).members == frozenset("ab")


def test_a_commit_that_would_narrow_the_round_to_its_own_payload_leaves_that_member_out():
    # e says it holds only its own and a's payload: it would make the round little more than its own update
    everyone = set("abcde")
    held = {"b": set(everyone), "c": set(everyone), "d": set(everyone), "e": {"a", "e"}}
    got = agree("a", everyone, held)
    assert got.members == frozenset("abcd")
    assert got.narrowed == {"e": (3, 4)}  # b, c and d left out, of the four this peer holds besides e's


def test_a_commit_missing_one_payload_narrows_the_round():
    # in a group of three, a commit missing one other payload narrows the round (2 x 1 is not more than 2)
    held = {"b": {"a", "b"}, "c": {"a", "b", "c"}}
    got = agree("a", {"a", "b", "c"}, held)
    assert got.members == frozenset("ab") and not got.narrowed


def test_unreadable_commits_hold_nothing_and_leave_their_senders_out():
    got = agree("a", {"a", "b", "c"}, {"b": set(), "c": set()})
    assert got.members == frozenset({"a"}) and not got.none_in_common


def test_no_payload_in_common_leaves_this_peer_alone():
    # each commit lacks two of the five other payloads (not enough to leave its sender out), and together they
    # lack every payload: nothing was agreed, and a goes on with its own
    everyone = set("abcdef")
    held = {"b": everyone - {"a", "c"}, "c": everyone - {"b", "d"}, "d": everyone - {"e", "f"}}
    got = agree("a", everyone, held)
    assert got.members == frozenset({"a"}) and got.none_in_common and not got.narrowed


def test_the_agreement_does_not_depend_on_the_order_commits_arrive_in():
    everyone = set("abcdef")
    held = {"b": set(everyone), "c": everyone - {"f"}, "d": {"d", "a"}, "e": everyone - {"b", "f"},
            "f": set(everyone)}
    outcomes = [agree("a", everyone, dict(order)) for order in itertools.permutations(held.items())]
    assert len({(o.members, tuple(sorted(o.narrowed.items())), o.none_in_common) for o in outcomes}) == 1


def test_survivors_that_saw_the_same_commits_agree_alike():
    # b never got d's payload; every member commits what it holds, and each computes the same set from its own
    # payloads and the others' commits
    everyone = set("abcd")
    commits = {"a": set(everyone), "b": everyone - {"d"}, "c": set(everyone), "d": set(everyone)}
    seen = {me: agree(me, commits[me], {p: h for p, h in commits.items() if p != me}).members for me in "abcd"}
    assert set(seen.values()) == {frozenset("abc")}


def test_commits_are_read_as_lists_of_peer_ids_and_junk_holds_nothing():
    acks = {"b": pack([b"a", b"b"]), "c": b"\xc1\xc1", "d": pack([1, 2])}  # ids; not msgpack; not ids
    held = read_acks(acks, lambda raw: raw.decode())
    assert held == {"b": {"a", "b"}, "c": set(), "d": set()}


def sketch(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_the_group_state_is_the_one_most_members_in_step_share():
    meta = {"a": {"fp": sketch(1, 2), "stale": False, "g": 3}, "b": {"fp": sketch(1, 2), "stale": False, "g": 3},
            "c": {"fp": sketch(5, 5), "stale": False, "g": 3}, "d": {"fp": sketch(5, 5), "stale": True, "g": 9}}
    members = sorted(meta)
    assert resync_sources(members, meta, sketch(1, 2)) == []
    assert resync_sources(members, meta, sketch(5, 5)) == ["a", "b"]  # d is behind: its vote does not count
    # the same state, rounded in the last bit on other hardware, is no reason to download
    assert resync_sources(members, meta, sketch(1 * (1 + 1e-7), 2)) == []


def test_equal_support_goes_to_the_state_of_the_larger_group_then_the_smaller_peer_id():
    meta = {"a": {"fp": sketch(1), "stale": False, "g": 1}, "b": {"fp": sketch(2), "stale": False, "g": 4}}
    assert resync_sources(["a", "b"], meta, sketch(1)) == ["b"]  # b's state came out of a group of four
    meta["b"]["g"] = 1
    assert resync_sources(["a", "b"], meta, sketch(2)) == ["a"]
