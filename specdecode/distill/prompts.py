"""Training prompts for self-distillation, written for this project (no external dataset).

None of them comes from Spec-Bench or HumanEval, so every benchmark prompt stays held out.
They cover the same kinds of work as the benchmark (conversation, translation, summarization,
question answering, arithmetic reasoning, retrieval-augmented answers, code), built from
topic lists and templates below; passages for summarization / RAG / translation prompts are
the target's own short articles on these topics (stage 1 of `corpus.build_corpus`).
Everything here is part of specdecode and under its license (Apache-2.0).
"""
from __future__ import annotations

import random

TOPICS = """
photosynthesis; black holes; the water cycle; plate tectonics; volcanoes; climate change; renewable energy;
solar panels; wind turbines; electric cars; batteries; the internet; how search engines work; computer
viruses; password security; cloud computing; machine learning; neural networks; quantum computers;
blockchain; the stock market; inflation; interest rates; budgeting; saving for retirement; starting a small
business; marketing on social media; job interviews; writing a resume; remote work; time management;
procrastination; sleep; meditation; healthy breakfast; drinking enough water; running a marathon; yoga;
strength training; vitamins; the immune system; vaccines; the human heart; the brain; memory; learning a
new language; reading habits; public libraries; the printing press; the Roman Empire; ancient Egypt; the
pyramids; the Renaissance; the industrial revolution; the French Revolution; the moon landing; the Silk
Road; the Great Wall of China; democracy; human rights; the United Nations; recycling; plastic pollution;
ocean currents; coral reefs; rainforests; deserts; bees and pollination; migratory birds; whales; dogs as
pets; cats; gardening; growing tomatoes; composting; baking bread; making pasta; coffee; tea ceremonies;
chocolate; spices; vegetarian cooking; food safety; traveling on a budget; packing for a trip; learning to
swim; cycling in cities; public transport; trains; airplanes; how rockets work; satellites; GPS; the solar
system; Mars exploration; stars; comets; the speed of light; gravity; magnetism; electricity at home;
semiconductors; smartphones; photography; painting with watercolors; playing the guitar; jazz; classical
music; writing poetry; short stories; chess; board games; video games; football; basketball; the Olympic
Games; mountain climbing; camping; first aid; earthquakes; hurricanes; weather forecasts; rainbows; the
periodic table; acids and bases; DNA; evolution; dinosaurs; fossils; microscopes; bacteria; antibiotics;
mental health; friendship; teamwork; leadership; public speaking; negotiation; customer service; open
source software; the Python programming language; databases; spreadsheets; email etiquette; online
privacy; artificial intelligence ethics; robots; 3D printing; architecture; bridges; skyscrapers; city
planning; housing; minimalism; moving to a new city; volunteering; raising children; teaching; exams;
online courses; museums; theatre; cinema; animation; fashion; sustainable clothing; the history of money;
taxes; insurance; credit cards; saving energy at home; water purification; agriculture; tractors; fishing;
forests; wildfires; glaciers; the Arctic; penguins; elephants; honey; cheese making; wine regions;
olive oil; rice; the history of tea; clocks; calendars; maps; lighthouses; castles; knights; samurai;
Vikings; the Olympic marathon; the human skeleton; muscles; nutrition labels; allergies; hospitals
"""

CHAT_TEMPLATES = (
    "Explain {t} to a beginner.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me five practical tips about {t}.",
    "Write a short story in which {t} plays an important role.",
    "What is {t}, and why does it matter?",
    "Write a persuasive paragraph about why people should learn about {t}.",
    "Describe the history of {t} in a few paragraphs.",
    "I am writing a school report on {t}. Can you give me an outline with headings?",
    "Answer briefly: what is the most common misconception about {t}?",
    "Write a friendly email to a colleague recommending a workshop on {t}.",
)
FOLLOW_UPS = ("Can you make that shorter?", "Please give one concrete example.", "Now explain it to a child.",
              "Rewrite your answer as a bulleted list.", "What should I read next to learn more?")
ARTICLE = "Write a short informative paragraph about {t}."
SUMMARIZE = ("Summarize the following text in two sentences.\n\n{p}", "Give a one-sentence summary of this "
             "passage:\n{p}", "Read the text below and list its three key points.\n\n{p}")
RAG = ("Use the passage to answer the question.\nPassage: {p}\nQuestion: What does the passage say about {t}?",
       "Context:\n{p}\n\nBased only on the context above, explain why {t} is important.")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese")
TRANSLATE = ("Translate the following sentence into {lang}: {s}", "Translate to {lang}:\n{s}")
CODE_TASKS = """
reverses a string; checks whether a number is prime; returns the n-th Fibonacci number; counts the vowels in
a string; removes duplicates from a list while keeping order; merges two sorted lists; computes the factorial
of n; checks whether a string is a palindrome; finds the largest element of a list; converts Celsius to
Fahrenheit; flattens a nested list; returns the most frequent word in a text; computes the average of a list
of numbers; sorts a list of dictionaries by a key; reads a CSV file and returns its rows; validates an email
address with a regular expression; computes the greatest common divisor of two numbers; transposes a matrix;
checks whether two strings are anagrams; returns all even numbers from a list; implements binary search;
counts the lines in a file; capitalizes every word in a sentence; computes the sum of the digits of a number;
generates all permutations of a list; checks balanced parentheses; converts a number to binary; implements
bubble sort; finds the second largest number in a list; splits a list into chunks of size n; computes the
mean and standard deviation; returns the intersection of two lists; implements a stack class; implements a
queue with two stacks; parses a date string; computes compound interest; returns the length of the longest
word; rotates a list by k positions; checks whether a year is a leap year; converts a Roman numeral to an integer
"""
CODE_TEMPLATES = ("Write a Python function that {c}.", "Write a Python function that {c}. Include a docstring "
                  "and a short example.", "How would you write a function that {c} in Python? Explain the code.")
ITEMS = ("apples", "pencils", "books", "tickets", "cookies", "marbles", "stamps", "bottles")
NAMES = ("Anna", "Ben", "Carlos", "Dana", "Elif", "Farid", "Grace", "Hiro")


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.replace("\n", " ").split(";") if t.strip()]


def topics() -> list[str]:
    return _split(TOPICS)


def math_problem(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(1, 20)
    kinds = (
        f"{name} has {a} {item}. {other} gives {name} {b} times as many {item} as {name} already has, and then "
        f"{name} gives away {c}. How many {item} does {name} have now? Explain step by step.",
        f"A shop sells {item} for {b} dollars each. {name} buys {a} of them and pays with a {a * b + c * 5} dollar "
        f"bill. How much change does {name} get? Show your reasoning.",
        f"{name} reads {b} pages every day. The book has {a * b + c} pages. How many days does {name} need to "
        f"finish it? Think step by step.",
        f"A train travels {a * 5} kilometers in {b} hours. At the same speed, how far does it travel in {b + c} "
        f"hours? Explain your answer.",
        f"What is {a} multiplied by {b}, plus {c * 7}? Solve it step by step.",
    )
    return rng.choice(kinds)


def article_requests() -> list[tuple[str, str]]:
    """(topic, request) for the passages of stage 1."""
    return [(t, ARTICLE.format(t=t)) for t in topics()]


def training_prompts(articles: dict[str, str], seed: int = 0) -> list[dict]:
    """All stage-2 prompts as {"id", "task", "messages"} (chat format), deterministic for a seed."""
    rng = random.Random(seed)
    rows: list[dict] = []

    def add(task: str, text: str, follow_up: str | None = None) -> None:
        rows.append({"id": f"{task}-{len(rows)}", "task": task, "messages": [{"role": "user", "content": text}],
                     "follow_up": follow_up})

    for t in topics():
        for template in rng.sample(CHAT_TEMPLATES, 4):
            add("chat", template.format(t=t), rng.choice(FOLLOW_UPS) if rng.random() < 0.25 else None)
    for t, passage in articles.items():
        add("summarization", rng.choice(SUMMARIZE).format(p=passage))
        add("rag", rng.choice(RAG).format(p=passage, t=t))
        first = passage.split(". ")[0].strip().rstrip(".") + "."
        add("translation", rng.choice(TRANSLATE).format(lang=rng.choice(LANGUAGES), s=first))
    for _ in range(240):
        add("math", math_problem(rng))
    for c in _split(CODE_TASKS):
        for template in rng.sample(CODE_TEMPLATES, 2):
            add("code", template.format(c=c))
    return rows
