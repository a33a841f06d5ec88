"""Write pagefleet_facts.jsonl: questions from small tables, three distractors from the same
table, choices shuffled (seed 31). Run from the repository root; the file is committed."""

import json
import random

rng = random.Random(31)
items = []
capitals = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "England": "London",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "India": "New Delhi",
    "Ireland": "Dublin",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Turkey": "Ankara",
    "Mexico": "Mexico City",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Thailand": "Bangkok",
    "Cuba": "Havana",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Hungary": "Budapest",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "South Korea": "Seoul",
    "Iran": "Tehran",
    "Chile": "Santiago",
    "Colombia": "Bogota",
    "Vietnam": "Hanoi",
    "Philippines": "Manila",
    "Indonesia": "Jakarta",
    "Czech Republic": "Prague",
    "Switzerland": "Bern",
}
cities = list(capitals.values())
for country, city in capitals.items():
    wrong = rng.sample([c for c in cities if c != city], 3)
    items.append((f"What is the capital of {country}?", city, wrong))
opposites = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "day": "night",
    "fast": "slow",
    "happy": "sad",
    "old": "young",
    "light": "dark",
    "open": "closed",
    "early": "late",
    "wet": "dry",
    "hard": "soft",
    "full": "empty",
    "rich": "poor",
    "strong": "weak",
    "loud": "quiet",
    "tall": "short",
    "clean": "dirty",
    "win": "lose",
    "buy": "sell",
}
words = list(opposites.values())
for a, b in opposites.items():
    items.append((f"What is the opposite of {a}?", b, rng.sample([w for w in words if w != b], 3)))
animals = {
    "dog": "bark",
    "cat": "meow",
    "cow": "moo",
    "duck": "quack",
    "sheep": "baa",
    "lion": "roar",
    "horse": "neigh",
    "pig": "oink",
    "snake": "hiss",
    "owl": "hoot",
    "bee": "buzz",
    "frog": "croak",
}
sounds = list(animals.values())
for a, s in animals.items():
    items.append((f"What sound does a {a} make?", s, rng.sample([x for x in sounds if x != s], 3)))
colors = {
    "the sky on a clear day": "blue",
    "grass": "green",
    "snow": "white",
    "a ripe banana": "yellow",
    "coal": "black",
    "a ripe tomato": "red",
    "an orange": "orange",
    "chocolate": "brown",
    "a lemon": "yellow",
    "blood": "red",
}
palette = ["blue", "green", "white", "yellow", "black", "red", "orange", "brown", "purple", "pink"]
for thing, c in colors.items():
    items.append((f"What color is {thing}?", c, rng.sample([x for x in palette if x != c], 3)))
names = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
for _ in range(20):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    s = a + b
    wrong = rng.sample([str(x) for x in range(2, 19) if x != s], 3)
    items.append((f"What is {a} plus {b}?", str(s), wrong))
days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
for i, d in enumerate(days):
    n = days[(i + 1) % 7]
    items.append(
        (f"Which day comes after {d}?", n, rng.sample([x for x in days if x not in (n, d)], 3))
    )
months = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
for i, m in enumerate(months):
    n = months[(i + 1) % 12]
    items.append(
        (f"Which month comes after {m}?", n, rng.sample([x for x in months if x not in (n, m)], 3))
    )
out = []
for q, right, wrong in items:
    choices = [*wrong, right]
    rng.shuffle(choices)
    out.append({"question": q, "choices": choices, "answer": choices.index(right)})
with open("benchmarks/lm_eval/pagefleet_facts.jsonl", "w") as f:
    for o in out:
        f.write(json.dumps(o) + "\n")
print(len(out))
