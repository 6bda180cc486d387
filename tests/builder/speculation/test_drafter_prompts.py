"""The drafter's prompt sets: training, validation and the speculative benchmark must not share a prompt or a topic."""

import re

from benchmarks.speculative import HELD_OUT_PROMPTS
from builder.speculation.drafter_prompts import (
    STYLES,
    TEMPLATES,
    TOPICS,
    VALIDATION_TEMPLATES,
    VALIDATION_TOPICS,
    drafter_prompts,
    validation_prompts,
)


def test_templates_and_topics_are_distinct_and_validation_shares_none():
    for items in (TEMPLATES, TOPICS, VALIDATION_TEMPLATES, VALIDATION_TOPICS):
        assert len(set(items)) == len(items)
        assert all(isinstance(item, str) and item.strip() == item and item for item in items)
    assert all(template.count("{topic}") == 1 for template in TEMPLATES + VALIDATION_TEMPLATES)
    assert not set(TEMPLATES) & set(VALIDATION_TEMPLATES)
    assert not {topic.lower() for topic in TOPICS} & {topic.lower() for topic in VALIDATION_TOPICS}


def test_prompt_lists_are_fixed_shuffled_prefixes():
    everything = drafter_prompts()
    assert len(everything) == len(set(everything)) == len(TEMPLATES) * len(TOPICS) * len(STYLES)
    assert drafter_prompts(100) == everything[:100] == drafter_prompts(100)
    assert drafter_prompts(100, seed=1) != drafter_prompts(100)
    # a prefix mixes templates, so a small training run does not see one request shape only
    assert (
        len({next(t for t in TEMPLATES if p.startswith(t.split("{topic}")[0])) for p in everything[:100]})
        > len(TEMPLATES) / 2
    )
    assert {style for style in STYLES if style} <= {s for p in everything[:100] for s in STYLES if s and p.endswith(s)}
    assert len(validation_prompts()) == len(VALIDATION_TEMPLATES) * len(VALIDATION_TOPICS)


def test_benchmark_prompts_are_in_neither_set():
    assert not set(HELD_OUT_PROMPTS) & (set(drafter_prompts()) | set(validation_prompts()))


def _stems(text: str) -> set[str]:
    """Content words, plural 's' dropped: 'rainbows' and 'a rainbow forms' share 'rainbow'."""
    return {word.lower().rstrip("s") for word in re.findall(r"[A-Za-z]+", text) if len(word) > 2} - {"the", "and"}


def test_benchmark_prompts_share_no_topic_with_training():
    # a topic word inside a benchmark word counts too ('bees' in 'honeybees'); generic words and false friends
    # ('table' in 'vegetable') are allowed
    generic = {"good", "thing", "table"}
    benchmark_words = set().union(*(_stems(prompt) for prompt in HELD_OUT_PROMPTS)) - generic
    for topic in TOPICS + VALIDATION_TOPICS:
        shared = {w for w in _stems(topic) - generic for b in benchmark_words if w == b or (len(w) >= 3 and w in b)}
        assert not shared, f"drafter topic {topic!r} is in a benchmark prompt ({shared})"
