"""`summary`: a short synthetic news article -> a one-sentence summary of its key facts.

The project's CNN/DailyMail stand-in. Each article comes from one of a few story types with a
fixed slot structure: three key-fact sentences (who, what number, what outcome) plus two
distractor sentences carrying other entities and numbers. Sentence order is shuffled, so a model
must find the key slots rather than copy a position. The reference summary restates only the key
facts in one fixed sentence shape.

Score: ROUGE-2 F1 (bigram overlap, `rouge-score` with stemming) against the reference, in [0, 1].
"""

from __future__ import annotations

import random
from functools import lru_cache

from training.tasks.base import Example

CITIES = ["Oakdale", "Riverton", "Maple Bay", "Stonefield", "Westport", "Ashby", "Lakeside", "Brookvale"]
PEOPLE = ["Nora Vance", "Omar Reyes", "Lena Park", "Hugo Stern", "Iris Cole", "Felix Ward", "Tara Quinn"]
TEAMS = ["the Hawks", "the Rovers", "the Comets", "the Tigers", "the Pilots", "the Wolves"]
FIRMS = ["Northwind", "Bluepeak", "Solara", "Kestrel Labs", "Vantage", "Orbis"]
PROJECTS = ["a new bridge", "two schools", "a bus line", "the harbor", "a library", "city parks"]
PRODUCTS = ["phones", "solar panels", "bicycles", "coffee machines", "drones"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
DISTRACTORS = [
    "The weather in {city} was mild at {n} degrees.",
    "A local bakery reported selling {n} pies that week.",
    "Traffic on the main road was slower than usual for {n} minutes.",
    "Earlier, a school choir of {n} children performed downtown.",
    "A nearby museum said it had {n} visitors on the same day.",
    "Officials noted that {n} streetlights were repaired.",
]


def _council(rng: random.Random) -> tuple[list[str], str]:
    city, mayor, proj = rng.choice(CITIES), rng.choice(PEOPLE), rng.choice(PROJECTS)
    money, yes, no = rng.randint(2, 90), rng.randint(5, 9), rng.randint(0, 4)
    facts = [
        f"The {city} council met on {rng.choice(DAYS)}.",
        f"Mayor {mayor} proposed spending {money} million on {proj}.",
        f"The plan passed by a vote of {yes} to {no}.",
    ]
    return facts, f"{city} council approved {money} million for {proj} in a {yes} to {no} vote."


def _match(rng: random.Random) -> tuple[list[str], str]:
    home, away = rng.sample(TEAMS, 2)
    hs, as_ = rng.randint(2, 9), rng.randint(0, 1)
    hs = max(hs, as_ + 1)
    star = rng.choice(PEOPLE)
    Home = "T" + home[1:]  # "the Hawks" -> "The Hawks" (str.capitalize would lowercase "Hawks")
    facts = [
        f"{Home} hosted {away} on {rng.choice(DAYS)}.",
        f"{Home} won the game {hs} to {as_}.",
        f"{star} scored {rng.randint(1, hs)} of the goals.",
    ]
    return facts, f"{Home} beat {away} {hs} to {as_}, led by {star}."


def _earnings(rng: random.Random) -> tuple[list[str], str]:
    firm, ceo, prod = rng.choice(FIRMS), rng.choice(PEOPLE), rng.choice(PRODUCTS)
    units, pct = rng.randint(10, 99), rng.randint(2, 40)
    facts = [
        f"{firm} released its results on {rng.choice(DAYS)}.",
        f"The company sold {units} thousand {prod} this quarter.",
        f"Chief executive {ceo} said profit rose {pct} percent.",
    ]
    return facts, f"{firm} sold {units} thousand {prod} and profit rose {pct} percent."


STORIES = [_council, _match, _earnings]


def make_one(rng: random.Random) -> Example:
    facts, summary = rng.choice(STORIES)(rng)
    distract = [d.format(city=rng.choice(CITIES), n=rng.randint(2, 99)) for d in rng.sample(DISTRACTORS, 2)]
    # The first sentence (setting) stays first like a news lede; the rest are shuffled.
    body = facts[1:] + distract
    rng.shuffle(body)
    article = " ".join([facts[0], *body])
    prompt = f"Summarize the article in one sentence.\n{article}"
    return Example("summary", "", prompt, summary, {})


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer  # lazy: importing rouge-score pulls in nltk

    return rouge_scorer.RougeScorer(["rouge2"], use_stemmer=True)


def score(example: Example, completion: str) -> float:
    """ROUGE-2 F1 between the completion and the reference summary."""
    return float(_scorer().score(example.reference, completion.strip())["rouge2"].fmeasure)
