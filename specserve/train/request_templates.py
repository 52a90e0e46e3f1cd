"""Requests built from hand-written templates, beside the ones the target writes itself.

Prompts a small target writes are short one-line asks, and its answers to
them often loop; the requests users send chat models are longer and more
specific: a form, an audience and constraints; a puzzle with its numbers; a
function to write; a passage to pull facts from. A head trained only on the
former drafts the latter poorly. These templates fill that gap with the same
categories chat benchmarks weigh (writing, role-play, reasoning, maths,
coding, extraction, science, humanities), with translation
(translation_requests.py) and code completion (code_requests.py), every slot
drawn from a seeded generator so that thousands of requests differ.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from specserve.train.code_requests import completion_request
from specserve.train.questions import TOPICS
from specserve.train.translation_requests import translation_request

NAMES = ("Alice", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yusuf")
COMPANIES = ("Northwind Foods", "Bluepeak Energy", "Orbital Robotics", "Greenleaf Pharma", "Silverline Motors",
             "Cedar & Co.", "Helios Solar", "Quantum Retail", "Atlas Logistics", "Nimbus Cloud", "Redwood Games")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Hanoi", "Cairo", "Denver", "Krakow", "Perth")

FORMS = ("blog post", "short story", "poem", "product description", "speech", "cover letter", "email",
         "persuasive essay", "news article", "review", "diary entry", "radio advertisement", "letter to the editor",
         "limerick", "social media post", "script for a one-minute video", "newsletter introduction", "toast")
AUDIENCES = ("high school students", "busy parents", "a group of investors", "first-time visitors",
             "your coworkers", "readers of a local newspaper", "children aged eight", "retired teachers",
             "a tech-savvy audience", "small business owners", "university freshmen", "a hiring manager")
CONSTRAINTS = ("Keep it under 200 words.", "Use a friendly, conversational tone.", "Include three concrete examples.",
               "End with a call to action.", "Use a formal tone.", "Give it a catchy title.", "Use headings.",
               "End with a surprising twist.", "Avoid technical jargon.", "Mention one common misconception.",
               "Write it in the second person.", "Make every sentence start with a different word.",
               "Include a short anecdote.", "Use exactly three paragraphs.", "Add a memorable final line.")
PERSONAS = ("a pirate captain", "a medieval knight", "a detective in 1920s London", "a friendly robot",
            "a famous chef", "an astronaut on the Moon", "a grumpy librarian", "a fitness coach",
            "a travel guide in Rome", "a wise old wizard", "a startup founder", "a museum curator",
            "a kindergarten teacher", "a sports commentator", "a time traveler from the year 3000",
            "a customer support agent", "a stand-up comedian", "a park ranger", "a ship's doctor")
SITUATIONS = ("Describe your typical day.", "Someone asks you for advice about {topic}. Answer them.",
              "Explain {topic} in your own style.", "Introduce yourself to a new apprentice.",
              "A visitor complains that they are bored. Cheer them up.",
              "Tell me about the hardest day of your career.",
              "Convince me to try something new related to {topic}.", "Give a short welcome speech to a crowd.")
CONCEPT_PAIRS = (("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("RAM", "storage"),
                 ("mitosis", "meiosis"), ("a list", "a tuple in Python"), ("inflation", "deflation"),
                 ("an atom", "a molecule"), ("TCP", "UDP"), ("stocks", "bonds"), ("a comet", "an asteroid"),
                 ("empathy", "sympathy"), ("socialism", "capitalism"), ("a simile", "a metaphor"),
                 ("nuclear fission", "nuclear fusion"), ("a democracy", "a republic"), ("DNA", "RNA"))
PROCESSES = ("a refrigerator keeps food cold", "vaccines train the immune system", "a bill becomes a law",
             "search engines rank web pages", "plants turn sunlight into energy", "an airplane stays in the air",
             "the heart pumps blood", "compound interest grows savings", "a compiler turns code into a program",
             "earthquakes happen", "a rainbow forms", "batteries store energy", "GPS finds your location")
EVENTS = ("the fall of the Roman Empire", "the Industrial Revolution", "the invention of the printing press",
          "the French Revolution", "the Cold War", "the first Moon landing", "the Black Death",
          "the rise of the Internet", "the Silk Road trade", "the end of apartheid", "the Renaissance")
THINKERS = ("Plato", "Aristotle", "Confucius", "Kant", "Adam Smith", "Karl Marx", "Simone de Beauvoir",
            "John Locke", "Nietzsche", "Hannah Arendt")
LANGUAGES = ("Python", "JavaScript", "C++", "Java", "Go", "Rust")
CODE_TASKS = ("checks whether a string is a palindrome", "returns the n-th Fibonacci number",
              "merges two sorted lists into one sorted list", "counts the words in a text file",
              "finds the second largest number in a list", "removes duplicates from a list while keeping order",
              "converts a temperature from Celsius to Fahrenheit", "checks whether a number is prime",
              "reverses the words in a sentence", "finds the longest common prefix of a list of strings",
              "computes the median of a list of numbers", "validates an email address",
              "implements binary search", "flattens a nested list", "returns the most frequent element in a list",
              "checks whether two strings are anagrams", "implements a simple stack class",
              "computes the factorial of a number recursively", "finds all pairs in a list that sum to a target")
CODE_EXTRAS = ("", " Include comments.", " Explain its time complexity.", " Add a short example of how to call it.",
               " Then write two unit tests for it.")
SQL_TASKS = ("lists the five customers who spent the most", "counts the orders placed in each month of 2023",
             "finds customers who have never placed an order", "computes the average order value per city",
             "finds the products that were never ordered")
ADJECTIVES = ("great", "terrible", "disappointing", "excellent", "average", "surprising", "overpriced", "wonderful")
PRODUCTS = ("phone", "blender", "laptop", "pair of running shoes", "coffee maker", "novel", "hotel stay", "movie")


def _writing(rng: random.Random, topics: Sequence[str]) -> str:
    extra = rng.sample(CONSTRAINTS, rng.randint(1, 2))
    return (f"Write a {rng.choice(FORMS)} about {rng.choice(topics)} for {rng.choice(AUDIENCES)}. "
            + " ".join(extra))


def _roleplay(rng: random.Random, topics: Sequence[str]) -> str:
    situation = rng.choice(SITUATIONS).format(topic=rng.choice(topics))
    opener = rng.choice(("Pretend you are {p}.", "Act as {p}.", "Imagine you are {p}.", "You are {p}."))
    return f"{opener.format(p=rng.choice(PERSONAS))} {situation} Stay in character."


def _reasoning(rng: random.Random, topics: Sequence[str]) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n, m = rng.randint(2, 15), rng.randint(2, 12)
    x = rng.randint(1, 9)
    kind = rng.randrange(6)
    if kind == 0:
        return (f"{a} is taller than {b}, and {b} is taller than {c}. Is {c} taller than {a}? "
                "Explain your reasoning step by step.")
    if kind == 1:
        return (f"{a} is {n} years older than {b}. In {m} years, {a} will be twice as old as {b} was {m} years ago "
                f"plus {x}. How old is each of them now? Show your reasoning.")
    if kind == 2:
        return (f"A farmer has {n * 3} chickens and {m} cows. {x} of the chickens are sold. How many legs do the "
                "remaining animals have in total? Think step by step.")
    if kind == 3:
        start, step = rng.randint(1, 20), rng.randint(2, 9)
        seq = ", ".join(str(start + i * step + (i * i if x % 2 else 0)) for i in range(5))
        return f"What is the next number in the sequence {seq}? Explain the pattern."
    if kind == 4:
        return (f"{a} has {n} apples. {b} gives {a} {m} more, and then {a} gives half of them to {c}. "
                f"How many apples does {a} have now? If the number is not whole, explain what happens.")
    return (f"There are {n + 3} people in a room and every person shakes hands with every other person exactly "
            "once. How many handshakes happen? Explain how you got the answer.")


def _math(rng: random.Random, topics: Sequence[str]) -> str:
    a, b, c = rng.randint(2, 12), rng.randint(1, 40), rng.randint(41, 120)
    kind = rng.randrange(7)
    if kind == 0:
        return f"Solve for x: {a}x + {b} = {c}. Show each step."
    if kind == 1:
        pts = [(rng.randint(-5, 9), rng.randint(-5, 9)) for _ in range(3)]
        return f"What is the area of a triangle with vertices at {pts[0]}, {pts[1]} and {pts[2]}?"
    if kind == 2:
        return (f"A jacket costs ${c} and is discounted by {rng.choice((10, 15, 20, 25, 30))}%, then a sales tax "
                f"of {rng.choice((5, 8, 10))}% is added. What is the final price?")
    if kind == 3:
        return f"Find the derivative of f(x) = {a}x^3 - {b}x^2 + {c}x - {a + b}, and evaluate it at x = {a % 5}."
    if kind == 4:
        return f"What is the probability of rolling a sum of {rng.randint(3, 11)} with two fair six-sided dice?"
    if kind == 5:
        return f"Find the greatest common divisor and the least common multiple of {a * b} and {a * c}."
    return f"A rectangle has a perimeter of {2 * (b + c)} cm and a length of {c} cm. What is its area?"


def _coding(rng: random.Random, topics: Sequence[str]) -> str:
    if rng.random() < 0.2:
        return ("Given tables customers(id, name, city), products(id, name, price) and orders(id, customer_id, "
                "product_id, amount, created_at), write a "
                f"SQL query that {rng.choice(SQL_TASKS)}. Explain how it works.")
    return f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}.{rng.choice(CODE_EXTRAS)}"


def _news_passage(rng: random.Random) -> str:
    lines = []
    for company in rng.sample(COMPANIES, rng.randint(2, 4)):
        year = rng.randint(2015, 2024)
        lines.append(f"{company}, based in {rng.choice(CITIES)}, reported revenue of ${rng.randint(5, 900)} "
                     f"million in {year}, {rng.choice(('up', 'down'))} {rng.randint(1, 40)}% from the year before. "
                     f"Its chief executive, {rng.choice(NAMES)} {rng.choice(('Ortiz', 'Kim', 'Novak', 'Mensah'))}, "
                     f"said the company would {rng.choice(('hire more staff', 'open new offices', 'cut costs'))}.")
    return " ".join(lines)


def _extraction(rng: random.Random, topics: Sequence[str]) -> str:
    if rng.random() < 0.5:
        ask = rng.choice(("Extract each company's name, city, revenue and year, and return them as JSON.",
                          "Which company had the highest revenue? Answer, then list the others in order.",
                          "Summarize these reports in one sentence per company."))
        return f"{_news_passage(rng)}\n\n{ask}"
    reviews = [f"Review {i + 1}: The {rng.choice(PRODUCTS)} was {rng.choice(ADJECTIVES)}. "
               f"{rng.choice(('I would buy it again.', 'It broke after a week.', 'Shipping was slow.', 'Worth it.'))}"
               for i in range(rng.randint(3, 5))]
    return ("Rate each of the following reviews on a scale of 1 to 5 and return the ratings as a JSON list.\n\n"
            + "\n".join(reviews))


def _stem(rng: random.Random, topics: Sequence[str]) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        x, y = rng.choice(CONCEPT_PAIRS)
        return f"What is the difference between {x} and {y}? Give an example of each."
    if kind == 1:
        return f"Explain step by step how {rng.choice(PROCESSES)}. {rng.choice(CONSTRAINTS)}"
    return f"Explain {rng.choice(topics)} to {rng.choice(AUDIENCES)}, and suggest a simple experiment or example."


def _humanities(rng: random.Random, topics: Sequence[str]) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"Discuss the main causes and consequences of {rng.choice(EVENTS)}. {rng.choice(CONSTRAINTS)}"
    if kind == 1:
        p, q = rng.sample(THINKERS, 2)
        return f"Compare the ideas of {p} and {q} about society. Where do they agree, and where do they differ?"
    return (f"What can people today learn from {rng.choice(EVENTS)} about {rng.choice(topics)}? "
            "Give three lessons with a short explanation each.")


CATEGORIES: dict[str, Callable[[random.Random, Sequence[str]], str]] = {
    "writing": _writing, "roleplay": _roleplay, "reasoning": _reasoning, "math": _math, "coding": _coding,
    "extraction": _extraction, "stem": _stem, "humanities": _humanities,
    "translation": translation_request, "code_completion": completion_request,
}


def templated_requests(n: int, seed: int, topics: Sequence[str] = TOPICS,
                       categories: Sequence[str] | None = None) -> list[str]:
    """n distinct requests about topics (fewer only if the templates run out), the categories (default: all of
    CATEGORIES) taking turns."""
    rng = random.Random(f"{seed}:templates")
    makers = [CATEGORIES[c] for c in (categories or CATEGORIES)]
    out: dict[str, None] = {}
    tries = 0
    while len(out) < n and tries < 20 * n:
        out[makers[tries % len(makers)](rng, topics)] = None
        tries += 1
    return list(out)
