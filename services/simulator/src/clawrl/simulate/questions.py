"""The open questions the simulated user asks (templates x topics), and the fixed held-out set
that `clawrl eval` scores and that training never sees: its topics are never asked in a session.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "What is {topic}?",
    "Can you explain {topic} to me?",
    "Why does {topic} matter?",
    "How does {topic} work?",
    "Tell me about {topic}.",
    "What should a beginner know about {topic}?",
    "What are the main ideas behind {topic}?",
    "Give me an overview of {topic}.",
)

TRAINING_TOPICS = (
    "photosynthesis", "the water cycle", "compound interest", "volcanoes", "the immune system",
    "machine learning", "black holes", "the Roman Empire", "climate change", "vaccines",
    "plate tectonics", "electricity", "the stock market", "recycling", "sleep", "coffee",
    "the internet", "gravity", "DNA", "renewable energy", "inflation", "honey bees", "the moon",
    "chess", "meditation", "jazz", "earthquakes", "exercise", "democracy", "rainbows",
    "batteries", "baking bread", "the human heart", "ocean tides", "solar panels",
    "the printing press", "gardening", "time zones", "coral reefs", "the French Revolution",
)  # fmt: skip

HELD_OUT_TOPICS = (
    "antibiotics", "the Silk Road", "nuclear fusion", "migratory birds", "credit scores",
    "the Renaissance", "glaciers", "public libraries",
)  # fmt: skip


def held_out_questions() -> list[str]:
    """The 32 held-out questions: each held-out topic with 4 of the templates (every template
    used 4 times), always the same list."""
    return [
        TEMPLATES[(i + 2 * j) % len(TEMPLATES)].format(topic=topic)
        for i, topic in enumerate(HELD_OUT_TOPICS)
        for j in range(4)
    ]


def training_question(rng: random.Random) -> str:
    """A question for a session: a training topic in a random template (never a held-out one)."""
    return rng.choice(TEMPLATES).format(topic=rng.choice(TRAINING_TOPICS))
