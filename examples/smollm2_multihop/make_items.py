"""The multi-hop task's items: a table of made-up people and their ages, and questions that need a ``lookup`` of a
person's age and then a ``calculator`` call on it ("How old will Bexmel be in 37 years?").

The names are built from syllables by a seeded generator (names the model cannot know), so the age must be looked
up; the arithmetic on it needs the calculator. The people are split: the training questions name only training
people, the held-out questions only held-out people (never seen in training, though the table knows them, as a
deployed tool would). Everything is a pure function of the seed.
"""

from __future__ import annotations

import random

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr", "gr", "st")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ou")
CODAS = ("", "n", "l", "r", "x", "m", "s", "th", "nd", "rk")
TEMPLATES = (
    ("How old will {name} be in {n} years?", "{age} + {n}", 1),
    ("How old was {name} {n} years ago?", "{age} - {n}", -1),
)
"""(question, the calculator expression, sign of ``n`` in the answer)."""
SUFFIX = " Answer with the number only."


def make_names(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct made-up names of two syllables ("Bexmel"), in a seeded order."""
    rng = random.Random(f"names:{seed}")
    names: list[str] = []
    seen = set()
    while len(names) < count:
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(2)).capitalize()
        if name not in seen and 5 <= len(name) <= 9:
            seen.add(name)
            names.append(name)
    return names


def make_table(count: int, seed: int = 0) -> dict[str, dict[str, int]]:
    """``{name: {"age": 18..80}}`` for ``count`` made-up people."""
    rng = random.Random(f"ages:{seed}")
    return {name: {"age": rng.randint(18, 80)} for name in make_names(count, seed)}


def question(name: str, age: int, n: int, template: int) -> dict:
    """One prompt row: the question (with the example's answer instruction), its answer and how it is solved."""
    text, expression, sign = TEMPLATES[template]
    return {
        "messages": [{"role": "user", "content": text.format(name=name, n=n) + SUFFIX}],
        "answer": str(age + sign * n),
        "name": name,
        "expression": expression.format(age=age, n=n),
    }


def make_items(
    table: dict[str, dict[str, int]], names: list[str], per_name: int, seed: int = 0, templates: tuple[int, ...] = (0,)
) -> list[dict]:
    """``per_name`` questions about each of ``names`` (the ``templates``, indices of :data:`TEMPLATES`, alternate;
    ``n`` from 2 to 49, below the age for "ago"), shuffled with ``seed``. The default asks only "How old will X be
    in N years?" (lookup, then an addition): the form the untrained model gets right now and then (screen)."""
    if not table:
        raise ValueError("make_items: the table is empty")
    if not templates or any(t not in range(len(TEMPLATES)) for t in templates):
        raise ValueError(
            f"make_items: templates must be indices of TEMPLATES (0 to {len(TEMPLATES) - 1}), got {templates}"
        )
    missing = [n for n in names if n not in table]
    if missing:
        raise ValueError(f"make_items: {missing[0]!r} is not in the table")
    rng = random.Random(f"items:{seed}")
    rows = []
    for name in names:
        age = table[name]["age"]
        for k in range(per_name):
            template = templates[(k + rng.randint(0, 1)) % len(templates)]
            n = rng.randint(2, min(49, age - 1) if TEMPLATES[template][2] < 0 else 49)
            rows.append(question(name, age, n, template))
    rng.shuffle(rows)
    return rows


def split(table: dict, held_out: int, examples: int) -> tuple[list[str], list[str], list[str]]:
    """The table's names as (worked-example people, training people, held-out people)."""
    names = list(table)
    if examples + held_out >= len(names):
        raise ValueError(f"a table of {len(names)} people leaves none to train on ({examples} + {held_out} set aside)")
    return names[:examples], names[examples : len(names) - held_out], names[len(names) - held_out :]
