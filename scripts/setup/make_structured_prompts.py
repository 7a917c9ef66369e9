"""Write specdecode/data/json_extract/validation.jsonl: 100 short texts for each of the 5 schemas in
specdecode/data/json_extract/schemas/ (person, product, event, recipe, book), each with the
instruction to extract it as JSON. Every text is composed here from small word lists with a fixed
seed (written for this project; no third-party text), so the file is reproducible:

    python scripts/setup/make_structured_prompts.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "specdecode" / "data" / "json_extract" / "validation.jsonl"
PER_SCHEMA = 100

FIRST = ["Maria", "Tom", "Aiko", "Lars", "Fatima", "Diego", "Chen", "Olga", "Samuel", "Priya", "Jonas", "Amara",
         "Luca", "Hana", "Pedro", "Ingrid", "Omar", "Sofia", "Kwame", "Elena"]
LAST = ["Lopez", "Baker", "Tanaka", "Nilsson", "Haddad", "Ramos", "Wei", "Petrova", "Okafor", "Sharma", "Weber",
        "Diallo", "Rossi", "Kim", "Silva", "Berg", "Khan", "Moreau", "Mensah", "Novak"]
CITIES = ["Valencia", "Leeds", "Osaka", "Uppsala", "Casablanca", "Lima", "Chengdu", "Kazan", "Lagos", "Pune",
          "Leipzig", "Dakar", "Turin", "Busan", "Porto", "Bergen", "Lahore", "Lyon", "Accra", "Brno"]
JOBS = ["nurse", "carpenter", "teacher", "pilot", "chemist", "baker", "architect", "librarian", "plumber",
        "journalist", "farmer", "dentist", "electrician", "translator", "chef", "engineer"]
HOBBIES = ["chess", "running", "fishing", "jazz", "painting", "hiking", "cycling", "poetry", "gardening",
           "photography", "climbing", "knitting", "surfing", "cooking"]
PRODUCTS = [("wireless headphones", "Sonora"), ("coffee grinder", "Brewline"), ("hiking boots", "Trailmark"),
            ("desk lamp", "Lumio"), ("electric kettle", "Boilwell"), ("yoga mat", "Flexa"),
            ("backpack", "Packwise"), ("smart watch", "Tikko"), ("blender", "Mixaro"), ("tent", "Campora")]
CURRENCIES = [("EUR", "euros"), ("USD", "dollars"), ("GBP", "pounds"), ("JPY", "yen")]
EVENTS = [("concert", "Summer Strings"), ("conference", "Data Days"), ("match", "City Derby"),
          ("festival", "Lantern Nights"), ("exhibition", "Modern Clay"), ("conference", "Green Build"),
          ("concert", "Midnight Brass"), ("festival", "Harvest Fair")]
DISHES = [("lentil soup", True), ("chicken curry", False), ("mushroom risotto", True), ("beef stew", False),
          ("vegetable lasagna", True), ("fish tacos", False), ("pancakes", True), ("lamb kebabs", False)]
INGREDIENTS = ["onion", "garlic", "tomato", "rice", "lentils", "carrot", "butter", "flour", "eggs", "milk",
               "chicken", "beef", "fish", "cheese", "basil", "potato"]
GENRES = ["novel", "poetry", "history", "science", "children"]
TITLE_WORDS = ["River", "Silent", "Garden", "Stars", "Winter", "Lost", "Salt", "Paper", "Iron", "Harbor",
               "Letters", "Orchard", "Tide", "Mountain", "Glass"]


def person(rng: random.Random) -> str:
    name, age, city = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(19, 88), rng.choice(CITIES)
    job, hobbies = rng.choice(JOBS), rng.sample(HOBBIES, rng.randint(1, 3))
    forms = [f"{name} is {age} years old and works as a {job} in {city}. They enjoy {' and '.join(hobbies)}.",
             f"Meet {name}: a {age}-year-old {job} living in {city}, who loves {', '.join(hobbies)}.",
             f"In {city} lives {name}, {age}, a {job} whose hobbies are {' and '.join(hobbies)}."]
    return rng.choice(forms)


def product(rng: random.Random) -> str:
    (item, brand), (code, word) = rng.choice(PRODUCTS), rng.choice(CURRENCIES)
    price = rng.randint(5, 400) if code != "JPY" else rng.randint(500, 40000)
    stock = rng.random() < 0.6
    status = "in stock" if stock else "sold out"
    return rng.choice([f"The {brand} {item} costs {price} {word} and is currently {status}.",
                       f"For {price} {word} you get the {item} by {brand}; the shop says it is {status}.",
                       f"{brand} sells a {item} at {price} {word}. Availability: {status}."])


def event(rng: random.Random) -> str:
    (kind, title), city = rng.choice(EVENTS), rng.choice(CITIES)
    date = f"{rng.randint(2024, 2027)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    people = rng.choice([120, 450, 900, 2500, 8000, 15000, 40000])
    return rng.choice([f"The {kind} \"{title}\" takes place in {city} on {date}, with {people} people expected.",
                       f"On {date}, {city} hosts {title}, a {kind} for about {people} attendees.",
                       f"{title} ({kind}) - {city}, {date}. Expected attendance: {people}."])


def recipe(rng: random.Random) -> str:
    dish, veg = rng.choice(DISHES)
    servings, minutes = rng.randint(1, 8), rng.choice([15, 20, 30, 45, 60, 90, 120])
    items = rng.sample([i for i in INGREDIENTS if not veg or i not in ("chicken", "beef", "fish")], rng.randint(2, 5))
    note = "It is vegetarian." if veg else "It contains meat or fish."
    return rng.choice([f"This {dish} serves {servings} and takes {minutes} minutes. "
                       f"You need {', '.join(items)}. {note}",
                       f"A {dish} for {servings} people, ready in {minutes} minutes, "
                       f"made with {' and '.join(items)}. {note}"])


def book(rng: random.Random) -> str:
    title = f"The {rng.choice(TITLE_WORDS)} {rng.choice(TITLE_WORDS)}"
    author, year = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(1850, 2025)
    genre, pages = rng.choice(GENRES), rng.randint(80, 900)
    return rng.choice([f"\"{title}\" is a {genre} book by {author}, published in {year}, {pages} pages long.",
                       f"{author} wrote {title} ({genre}) in {year}; it has {pages} pages.",
                       f"Published {year}: {title}, {pages} pages of {genre}, by {author}."])


MAKERS = {"person": (person, "the person", "name, age, city, occupation and hobbies"),
          "product": (product, "the product", "product, brand, price, currency and in_stock"),
          "event": (event, "the event", "title, date (YYYY-MM-DD), city, attendees and kind"),
          "recipe": (recipe, "the recipe", "dish, servings, minutes, ingredients and vegetarian"),
          "book": (book, "the book", "title, author, year, genre and pages")}


def main() -> None:
    rng = random.Random(20261125)
    lines = []
    for schema, (make, what, fields) in MAKERS.items():
        for i in range(PER_SCHEMA):
            text = f"Extract {what} in this text as JSON with the fields {fields}.\n\nText: {make(rng)}"
            lines.append(json.dumps({"id": f"{schema}-{i:03d}", "task": f"json_{schema}", "schema": schema,
                                     "text": text, "chat": True}))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {OUT}")


if __name__ == "__main__":
    main()
