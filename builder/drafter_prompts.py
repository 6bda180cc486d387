"""Chat prompts a draft head is distilled on: the target answers them and the head learns to predict its answers.

Written for this project (Apache-2.0, like the rest of it): every request template crossed with every topic, in a
fixed shuffled order, so any prefix of the list mixes templates and topics. The benchmark's chat prompts
(benchmarks/speculative.py) use other templates and topics, so acceptance is measured on prompts the head never saw.
"""

from __future__ import annotations

import random

TEMPLATES = [
    "Explain {topic} to a beginner.",
    "What are the main advantages and disadvantages of {topic}?",
    "Give me three practical tips about {topic}.",
    "Write a short paragraph about the history of {topic}.",
    "What is a common misconception about {topic}?",
    "Summarize the key ideas of {topic} in a few sentences.",
    "How would you teach {topic} to a ten-year-old?",
    "List five questions a student might ask about {topic}.",
    "Write a short story that involves {topic}.",
    "Why does {topic} matter in everyday life?",
    "Compare {topic} with something similar and describe the differences.",
    "What should someone know before getting started with {topic}?",
]

TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "machine learning", "the French Revolution",
    "volcanoes", "healthy sleep habits", "public speaking", "recycling", "the solar system", "prime numbers",
    "gardening", "electric cars", "the human heart", "learning a new language", "climate change", "chess",
    "cooking pasta", "budgeting", "the internet", "vaccines", "earthquakes", "meditation", "the Roman Empire",
    "bees and pollination", "renewable energy", "writing a resume", "the stock market", "black holes",
    "time management", "coffee", "the printing press", "ocean tides", "friendship", "running a marathon",
    "computer passwords", "rainbows", "democracy", "baking bread", "dinosaurs",
]


def drafter_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    prompts = [template.format(topic=topic) for template in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(prompts)
    return prompts if count is None else prompts[:count]
