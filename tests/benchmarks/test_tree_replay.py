"""tree_replay on a tiny ReDrafter engine: the replayed greedy walk accepts what the engine itself accepted."""

import json

from click.testing import CliRunner

from benchmarks.tree_replay import answer, main, tokens_per_step
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine

PROMPTS = ["Tell me a story about a robot.", "List three colours.", "What is two plus two?"]


def test_the_replay_accepts_what_the_engine_accepted(engine_factory, tiny_draft_head):
    engine_dir = engine_factory("gqa", prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4)
    # every step verifies its drafts (no cost model), as the replay assumes
    engine = LLMEngine(EngineArgs(engine_dir, threads=1, speculative_max_rows=None))
    answers = [answer(engine, text, 24) for text in PROMPTS]
    stats = engine.speculation_stats
    assert stats.verify_steps > 0 and stats.mean_accepted > 1.0  # the tiny head's drafts were accepted at times
    assert tokens_per_step(engine.speculation, answers, engine.max_verify_nodes) == stats.mean_accepted
    assert tokens_per_step(engine.speculation, answers, 2) <= stats.mean_accepted


def test_the_command_reports_every_node_limit(engine_factory, tiny_draft_head, tmp_path):
    engine_dir = engine_factory("gqa", prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4)
    out = tmp_path / "replay.json"
    result = CliRunner().invoke(main, [str(engine_dir), "--threads", "1", "--new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for name in ("held_out_chat", "validation"):
        per_limit = report[name]["tokens_per_verify_step"]
        assert list(per_limit) == ["3", "4", "5", "6", "whole"]
        assert 1.0 <= per_limit["3"] <= per_limit["whole"]


def test_a_plain_engine_is_refused(engine_factory):
    result = CliRunner().invoke(main, [str(engine_factory("gqa")), "--threads", "1"])
    assert result.exit_code != 0 and "not a ReDrafter engine" in result.output
