"""The speculation policy (runner/speculative/policy.py): which kind of step it picks from the times it measured."""

from __future__ import annotations

from runner.speculative.policy import SpeculationPolicy


def choices(policy: SpeculationPolicy, rows: int, steps: int, plain_seconds: float, verify_seconds: float, emitted):
    """Run `steps` steps of `rows` rows, each timed as the given kind takes; -> the kinds chosen."""
    chosen = []
    for _ in range(steps):
        verifies = policy.verifies(rows)
        chosen.append("verify" if verifies else "plain")
        if verifies:
            policy.record_verify(rows, verify_seconds, emitted)
        else:
            policy.record_plain(rows, plain_seconds)
    return chosen


def test_a_fixed_row_limit_ignores_times():
    policy = SpeculationPolicy(max_rows=2)
    assert policy.verifies(1) and policy.verifies(2) and not policy.verifies(3)


def test_each_kind_is_timed_twice_then_the_faster_is_kept_and_the_other_retried_ever_less_often():
    policy = SpeculationPolicy(explore_every=8, max_explore_every=16, min_verified_rows=2)
    # verify: 2 tokens per row in 15 ms; plain: 1 in 10 ms -> verifying emits 1.33x the tokens per second
    chosen = choices(policy, 1, 60, plain_seconds=0.010, verify_seconds=0.015, emitted=2)
    assert chosen[:4] == ["plain", "plain", "verify", "verify"]
    # retried after 8 comparisons, then after 16, 16 (each retry confirmed the choice)
    assert [i + 1 for i, kind in enumerate(chosen) if kind == "plain"] == [1, 2, 12, 28, 44, 60]
    assert policy.tokens_per_verify() == 2.0
    assert policy.estimates()[1] == {
        "tree_nodes": None,
        "plain_seconds": 0.010,
        "verify_seconds": 0.015,
        "tokens_per_verify": 2.0,
    }


def test_verification_is_judged_only_once_enough_rows_have_verified():
    policy = SpeculationPolicy(explore_every=1000, min_verified_rows=6)
    # the first verify steps accept nothing (1 token a row): verifying would lose, but 2 steps of 2 rows are too few
    early = choices(policy, 2, 4, plain_seconds=0.010, verify_seconds=0.012, emitted=2)
    assert early == ["plain", "plain", "verify", "verify"] and policy.verifies(2)
    policy.record_verify(2, 0.012, 2 * 3)  # then a step accepts 2 drafts a row: 10 tokens in 6 rows now
    assert policy.tokens_per_verify(2) == 10 / 6 and policy.verifies(2)  # 1.67 tokens in 1.2x the time: verify pays
    # with the same 2 steps that accept nothing and no minimum, the policy turns to plain at once
    hasty = SpeculationPolicy(explore_every=1000, min_verified_rows=1)
    assert choices(hasty, 2, 5, plain_seconds=0.010, verify_seconds=0.012, emitted=2)[4] == "plain"


def test_the_heads_expected_tokens_per_verify_step_outweigh_an_opening_that_accepts_nothing():
    # 16 rows that emit 1 token each, verify steps taking 1.2x a decode step's time
    informed = SpeculationPolicy(explore_every=1000, prior_tokens_per_verify=2.0, prior_rows=32)
    assert informed.tokens_per_verify() == 2.0
    assert choices(informed, 1, 19, plain_seconds=0.010, verify_seconds=0.012, emitted=1)[-1] == "verify"
    assert informed.tokens_per_verify() == (2.0 * 32 + 17) / (32 + 17)
    # the measured mean decides in the end: the same steps for long enough turn the choice to plain
    assert choices(informed, 1, 200, plain_seconds=0.010, verify_seconds=0.012, emitted=1)[-1] == "plain"
    uninformed = SpeculationPolicy(explore_every=1000)
    assert choices(uninformed, 1, 19, plain_seconds=0.010, verify_seconds=0.012, emitted=1)[-1] == "plain"


def test_rows_counts_are_judged_apart_and_the_choice_follows_the_times():
    policy = SpeculationPolicy(explore_every=1000, min_verified_rows=2)
    # four rows: a verify step (1.8 tokens a row) costs 2.5x a decode step -> plain wins
    loaded = choices(policy, 4, 20, plain_seconds=0.010, verify_seconds=0.025, emitted=4 * 2)
    assert loaded[4:] == ["plain"] * 16
    # one row: verifying pays, and what four rows measured does not change that
    alone = choices(policy, 1, 20, plain_seconds=0.005, verify_seconds=0.007, emitted=2)
    assert alone[4:] == ["verify"] * 16
    # the verify steps slow down (say, longer contexts): the choice turns
    assert choices(policy, 1, 30, plain_seconds=0.005, verify_seconds=0.020, emitted=2)[-10:] == ["plain"] * 10


def test_a_plain_choice_lends_its_steps_up_to_the_next_retry_to_a_burst_of_decode_calls():
    policy = SpeculationPolicy(explore_every=8, max_explore_every=8, min_verified_rows=2)
    assert policy.plain_burst(4, 8) == 1  # nothing timed yet
    # four rows: plain wins; 2 steps of each kind timed, then plain chosen with 7 more plain steps before the retry
    assert choices(policy, 4, 5, plain_seconds=0.010, verify_seconds=0.025, emitted=4 * 2)[4] == "plain"
    assert policy.plain_burst(4, 5) == 5 and policy.plain_burst(4, 5) == 1  # 2 left: a burst of 1 is no burst
    then = choices(policy, 4, 3, plain_seconds=0.010, verify_seconds=0.025, emitted=4 * 2)
    assert then == ["plain", "verify", "plain"]  # the retry comes when it would have
    # where verifying wins there is no burst; a fixed row limit bursts the steps it keeps plain
    assert choices(policy, 1, 5, plain_seconds=0.010, verify_seconds=0.011, emitted=2)[4] == "verify"
    assert policy.plain_burst(1, 8) == 1
    fixed = SpeculationPolicy(max_rows=2)
    assert fixed.plain_burst(2, 8) == 1 and fixed.plain_burst(3, 8) == 8


def test_rows_verified_together_share_a_calls_tokens_and_a_tree_without_room_for_a_draft_decodes_plain():
    policy = SpeculationPolicy(call_tokens=6, min_verified_rows=2)
    assert [policy.tree_nodes(rows) for rows in (1, 2, 3, 4)] == [6, 3, 2, 1]
    assert not policy.verifies(4) and policy.plain_burst(4, 8) == 8  # plain without timing anything
    assert not SpeculationPolicy(max_rows=None, call_tokens=4).can_verify(3)
    assert SpeculationPolicy(max_tree_nodes=4).tree_nodes(8) == 4  # a fixed limit holds at every row count
    assert SpeculationPolicy().tree_nodes(8) is None and SpeculationPolicy().can_verify(8)


def test_tokens_per_verify_step_is_kept_per_tree_size_and_the_prior_is_one_rows_trees():
    policy = SpeculationPolicy(call_tokens=4, prior_tokens_per_verify=2.0, prior_rows=32, explore_every=1000)
    assert policy.tokens_per_verify(1) == 2.0 and policy.tokens_per_verify(2) is None  # 2-node trees: nothing known
    # two rows of 2-node trees: 1.5 tokens a row, in 1.3x a decode step of two rows -> verifying pays (1.15x)
    chosen = choices(policy, 2, 24, plain_seconds=0.010, verify_seconds=0.013, emitted=3)
    assert chosen[:4] == ["plain", "plain", "verify", "verify"] and chosen[-1] == "verify"
    assert policy.tokens_per_verify(2) == 1.5 and policy.tokens_per_verify(1) == 2.0  # one row's mean untouched
    policy.record_verify(1, 0.010, 1)
    assert policy.tokens_per_verify(1) == (64 + 1) / 33
    assert policy.estimates()[2]["tree_nodes"] == 2 and policy.estimates()[2]["tokens_per_verify"] == 1.5


def test_one_rows_verify_steps_tell_what_the_smaller_trees_of_more_rows_would_accept():
    policy = SpeculationPolicy(call_tokens=8, min_verified_rows=6)
    assert [policy.tree_nodes(rows) for rows in (1, 2, 3)] == [8, 4, 2]
    # one row's 8-node trees: a step that accepted nodes 1 and 5 (3 tokens), one that accepted node 2 (2 tokens), and
    # one that accepted nothing (1 token); node i of a tree is its i-th choice, so a 4-node tree is nodes 0-3
    for accepted in ([1, 5], [2], [], [1, 5]):
        policy.record_verify(1, 0.010, len(accepted) + 1, [(len(accepted) + 1, accepted)])
    assert policy.tokens_per_verify(1) == (3 + 2 + 1 + 3) / 4
    assert policy.tokens_per_verify(2) == (2 + 2 + 1 + 2) / 4  # 4 nodes: node 5 is not in them
    assert policy.tokens_per_verify(3) == (2 + 1 + 1 + 2) / 4  # 2 nodes: the root and node 1
    # so two rows compare as soon as both kinds are timed there (2 verify steps: 4 rows of their own and the 4
    # replayed make the 6 asked for): verifying at 2 rows takes 2x a decode step here, and loses at once
    chosen = choices(policy, 2, 5, plain_seconds=0.010, verify_seconds=0.020, emitted=2 * 2)
    assert chosen == ["plain", "plain", "verify", "verify", "plain"]
    # a row that finished within its tree emits fewer tokens than its path: the replay holds to what it emitted
    finished = SpeculationPolicy(call_tokens=8)
    finished.record_verify(1, 0.010, 1, [(1, [1, 2])])
    assert finished.tokens_per_verify(2) == 1.0


def test_a_retry_replaces_the_losing_kinds_stale_average():
    """Slow verify steps early on (a noisy spell) turn the choice to plain; once verify steps are fast again, the
    first retry's timing stands for them, not a fifth of it smoothed into the old average."""
    policy = SpeculationPolicy(explore_every=8, max_explore_every=64, min_verified_rows=2)
    slow = choices(policy, 1, 11, plain_seconds=0.010, verify_seconds=0.030, emitted=2)
    assert slow[4:] == ["plain"] * 7  # 2 tokens in 3x the time
    recovered = choices(policy, 1, 3, plain_seconds=0.010, verify_seconds=0.014, emitted=2)
    assert recovered == ["verify", "verify", "verify"]  # the retry (the 8th comparison), then verify is kept
    smoothed = 0.030 + 0.2 * (0.014 - 0.030)  # what the retry would have left: 2 tokens in 2.7x the time, plain
    assert policy.estimates()[1]["verify_seconds"] < 0.015 < smoothed
