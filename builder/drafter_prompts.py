"""Chat prompts a draft head is distilled on: the target answers them and the head learns to predict its answers.

Written for this project (Apache-2.0, like the rest of it): request templates crossed with topics, in a fixed
shuffled order, so any prefix of the list mixes templates and topics. Validation prompts use templates AND topics
that training never sees, so the acceptance measured on them is what a user's new prompts get (a head measured on
unseen combinations of seen templates and topics looked 40% better than it was on new prompts). The benchmark's
prompts (benchmarks/speculative.py) are a third, separate set.
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
    "Write a short poem about {topic}.",
    "Describe {topic} in simple words.",
    "What are the most important facts about {topic}?",
    "Can you give me an example of {topic} in action?",
    "Write a friendly email to a colleague about {topic}.",
    "What are the steps involved in {topic}?",
    "How has {topic} changed over the last hundred years?",
    "Tell me something surprising about {topic}.",
    "What would a world without {topic} look like?",
    "Create a short quiz with answers about {topic}.",
    "Give me a one-sentence definition of {topic}, then explain it.",
    "What are the risks associated with {topic}?",
]

TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "machine learning", "the French Revolution",
    "volcanoes", "healthy sleep habits", "public speaking", "recycling", "the solar system", "prime numbers",
    "gardening", "electric cars", "the human heart", "learning a new language", "climate change", "chess",
    "cooking pasta", "budgeting", "the internet", "vaccines", "earthquakes", "meditation", "the Roman Empire",
    "bees and pollination", "renewable energy", "writing a resume", "the stock market", "black holes",
    "time management", "coffee", "the printing press", "ocean tides", "friendship", "running a marathon",
    "computer passwords", "rainbows", "democracy", "baking bread", "dinosaurs", "the moon landing", "jazz music",
    "the immune system", "plate tectonics", "social media", "electricity", "the Great Wall of China",
    "camping in the mountains", "recycling plastic", "artificial intelligence", "the Olympic Games", "bicycles",
    "hurricanes", "the periodic table", "first aid", "photography", "the Renaissance", "nutrition", "robots",
    "the Amazon rainforest", "saving money", "yoga", "video games", "the human brain", "airplanes", "tea",
    "volunteering", "deserts", "the theory of evolution", "smartphones", "ancient Egypt", "wind turbines",
    "job interviews", "penguins", "the speed of light", "knitting", "cryptography", "coral reefs", "soccer",
    "the Industrial Revolution", "mushrooms", "3D printing", "glaciers", "recycling electronics", "poetry",
    "the human skeleton", "trains", "composting", "magnets", "the Silk Road", "sharks", "solar panels",
    "public libraries", "the stock exchange", "origami", "bridges", "weather forecasting", "the Internet of Things",
    "classical music", "honey", "space telescopes", "kindness", "calendars", "submarines", "spices",
]

VALIDATION_TEMPLATES = [
    "I am curious about {topic}. Where should I start?",
    "Write a brief encyclopedia-style entry on {topic}.",
    "What advice would an expert give about {topic}?",
    "Explain how {topic} works, step by step.",
]

VALIDATION_TOPICS = [
    "lighthouses", "the piano", "thunderstorms", "pottery", "elephants", "the metric system", "chocolate",
    "skyscrapers", "birdwatching", "board games",
]


def _shuffled(templates: list[str], topics: list[str], seed: int) -> list[str]:
    prompts = [template.format(topic=topic) for template in templates for topic in topics]
    random.Random(seed).shuffle(prompts)
    return prompts


def drafter_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """Training prompts (up to len(TEMPLATES) x len(TOPICS) = 2,496)."""
    prompts = _shuffled(TEMPLATES, TOPICS, seed)
    return prompts if count is None else prompts[:count]


def validation_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """Prompts whose template and topic training never saw (40)."""
    prompts = _shuffled(VALIDATION_TEMPLATES, VALIDATION_TOPICS, seed)
    return prompts if count is None else prompts[:count]
