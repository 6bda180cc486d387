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
    "Write a short dialogue between two friends discussing {topic}.",
    "What are some common mistakes people make with {topic}?",
    "Give me a short outline for a presentation on {topic}.",
    "Explain {topic} using an analogy.",
    "Write a tweet about {topic}.",
    "What jobs are related to {topic}?",
    "Describe a typical day of someone who works with {topic}.",
    "What are three fun facts about {topic}?",
    "How can I explain {topic} to my grandmother?",
    "Write a limerick about {topic}.",
    "What questions remain unanswered about {topic}?",
    "What books or resources would you recommend for learning about {topic}?",
    "Write a diary entry from the perspective of someone discovering {topic}.",
    "What is the future of {topic}?",
    "Write a short news report about {topic}.",
    "Which words should I know to talk about {topic}?",
    "Argue for and against {topic} in two short paragraphs.",
    "Plan a one-week study schedule for {topic}.",
    "What would a scientist say about {topic}?",
    "Write a motivational message about {topic}.",
]

TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "machine learning", "the French Revolution",
    "volcanoes", "healthy sleep habits", "public speaking", "recycling", "the solar system", "prime numbers",
    "gardening", "electric cars", "the human heart", "learning a new language", "chess",
    "cooking pasta", "budgeting", "the internet", "vaccines", "earthquakes", "meditation", "the Roman Empire",
    "renewable energy", "writing a resume", "the stock market", "black holes",
    "time management", "coffee", "the printing press", "ocean tides", "friendship", "running a marathon",
    "computer passwords", "democracy", "baking bread", "dinosaurs", "the moon landing", "jazz music",
    "the immune system", "plate tectonics", "social media", "electricity", "the Great Wall of China",
    "camping in the mountains", "recycling plastic", "artificial intelligence", "the Olympic Games", "bicycles",
    "hurricanes", "the periodic table", "first aid", "photography", "the Renaissance", "nutrition", "robots",
    "the Amazon rainforest", "saving money", "yoga", "video games", "the human brain", "airplanes",
    "volunteering", "deserts", "the theory of evolution", "smartphones", "ancient Egypt", "wind turbines",
    "job interviews", "penguins", "the speed of light", "knitting", "cryptography", "coral reefs", "soccer",
    "the Industrial Revolution", "mushrooms", "3D printing", "glaciers", "recycling electronics", "poetry",
    "the human skeleton", "trains", "composting", "magnets", "the Silk Road", "sharks", "solar panels",
    "public libraries", "the stock exchange", "origami", "bridges", "the Internet of Things",
    "classical music", "space telescopes", "kindness", "calendars", "submarines", "spices",
    "octopuses", "quantum computing", "gravity", "the Pacific Ocean", "wolves", "the violin", "opera", "museums",
    "fossils", "the Arctic", "hot air balloons", "dogs", "cats", "horses", "whales", "butterflies", "ants",
    "spiders", "rivers", "waterfalls", "caves", "islands", "snowflakes", "the northern lights", "comets", "Mars",
    "the Sun", "satellites", "rockets", "the International Space Station", "microscopes", "bacteria", "DNA",
    "genetics", "antibiotics", "the common cold", "allergies", "dental hygiene", "good posture", "stretching",
    "swimming", "basketball", "tennis", "hiking", "skiing", "fishing", "sailing", "surfing", "rock climbing",
    "martial arts", "dance", "ballet", "theatre", "film making", "animation", "comic books",
    "watercolor painting", "sculpture", "interior design", "fashion", "sewing", "woodworking", "calligraphy",
    "handwriting", "spelling", "grammar", "punctuation", "storytelling", "fairy tales", "mythology",
    "the Greek gods", "the Vikings", "the Aztecs", "medieval castles", "knights", "pirates", "samurai",
    "the Cold War", "the United Nations", "elections", "taxes", "insurance", "mortgages", "credit cards",
    "inflation", "supply and demand", "small businesses", "marketing", "negotiation", "leadership", "teamwork",
    "remote work", "email etiquette", "spreadsheets", "databases", "programming in Python",
    "open source software", "computer viruses", "cloud computing", "web browsers", "search engines",
    "virtual reality", "drones", "self-driving cars", "batteries", "nuclear power", "hydroelectric dams",
    "water purification", "air pollution", "forests", "wetlands", "urban gardening", "houseplants", "tomatoes",
    "apples", "rice", "cheese", "olive oil", "fermentation", "breakfast", "table manners", "birthdays",
    "weddings", "holidays around the world", "traveling on a budget", "packing a suitcase", "maps", "compasses",
    "clocks", "coins", "stamps", "postcards", "the telephone", "radio", "television", "newspapers", "podcasts",
    "bookshops", "reading habits", "memory", "habits", "motivation", "stress", "happiness", "empathy",
    "curiosity", "patience", "parenting", "siblings", "grandparents", "neighbours", "city planning",
    "public transport", "traffic lights", "roads", "tunnels", "ships", "the Titanic", "canals", "fire safety",
    "firefighters", "nurses", "teachers", "farmers", "astronauts", "inventors", "Leonardo da Vinci",
    "Marie Curie", "Isaac Newton", "Albert Einstein", "Shakespeare", "fractions", "geometry", "statistics",
    "probability", "algebra", "the number zero", "infinity", "logic puzzles", "sudoku", "crossword puzzles",
    "magic tricks", "circuses", "zoos", "aquariums", "national parks", "mountains", "the Himalayas", "the Nile",
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
    """Training prompts (up to len(TEMPLATES) x len(TOPICS) = 44 x 288 = 12,672)."""
    prompts = _shuffled(TEMPLATES, TOPICS, seed)
    return prompts if count is None else prompts[:count]


def validation_prompts(count: int | None = None, seed: int = 0) -> list[str]:
    """Prompts whose template and topic training never saw (40)."""
    prompts = _shuffled(VALIDATION_TEMPLATES, VALIDATION_TOPICS, seed)
    return prompts if count is None else prompts[:count]
