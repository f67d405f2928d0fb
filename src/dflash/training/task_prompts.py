"""General-assistant training requests built procedurally: writing, role play, reasoning, math, extraction, STEM
and humanities questions, and tasks over passages of public-domain texts.

Chat data (ShareGPT) is thin on some kinds of request an assistant meets every day: short creative pieces with
constraints, staying in a persona, worked arithmetic and algebra, small logic puzzles, pulling fields out of a
text. The target answers these requests itself, like every training prompt; this module only supplies varied
requests. Every builder draws from a seeded `random.Random`, so a set is reproducible from its seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path

FORMS = (
    "short story", "poem", "haiku sequence", "limerick", "sonnet", "blog post", "persuasive essay", "product description",
    "cover letter", "formal email", "thank-you note", "speech", "toast for a wedding", "news article", "press release",
    "travel diary entry", "restaurant review", "book review", "movie pitch", "dialogue between two friends",
    "letter to a future self", "motivational message", "advertisement", "song chorus", "fable with a moral",
    "opening paragraph of a mystery novel", "social media post", "podcast introduction", "lesson plan outline",
    "job posting", "apology letter", "museum placard", "children's bedtime story", "recipe introduction",
    "op-ed column", "eulogy", "character sketch", "radio commercial", "newsletter section", "FAQ section",
)
TOPICS = (
    "a lighthouse keeper who finds a message in a bottle", "the first day at a new school", "a city without cars",
    "learning to cook from a grandparent", "a robot that wants to paint", "climate change and coastal towns",
    "the benefits of remote work", "a lost dog finding its way home", "a small bakery competing with a chain store",
    "the history of the bicycle", "a friendship between a farmer and an astronaut", "the value of public libraries",
    "a rainy afternoon in Tokyo", "a mountain hiking trip that went wrong", "a new smartphone with a week of battery",
    "an electric car for families", "a community garden", "the importance of sleep", "a chess tournament final",
    "moving to another country", "a time traveller stuck in 1850", "the ocean at night", "a village festival",
    "a startup that recycles old clothes", "volunteering at an animal shelter", "a winter storm", "a jazz musician",
    "the invention of the printing press", "a marathon runner's last mile", "an abandoned amusement park",
    "saving money as a student", "a train journey across Canada", "a dragon who is afraid of fire",
    "the joy of reading aloud", "a scientist discovering a new species", "a family reunion after twenty years",
    "learning a second language as an adult", "a coffee shop that only opens at midnight", "renewable energy",
    "a teacher who changed someone's life", "a desert caravan", "artificial intelligence in hospitals",
    "the last day of summer", "a secret garden behind a library", "a noise-cancelling headphone brand",
    "a local football team's unexpected win", "a ghost who haunts a bookstore", "urban beekeeping",
    "a solar-powered backpack", "a tea ceremony", "the first snowfall of the year", "a violin maker's workshop",
)
AUDIENCES = (
    "children aged eight", "busy professionals", "retired teachers", "university students", "first-time parents",
    "software engineers", "tourists visiting for one day", "small business owners", "a skeptical reader",
    "people who have never heard of it",
)
CONSTRAINTS = (
    "Keep it under 150 words.", "Use exactly three paragraphs.", "Write it in the second person.",
    "Include a surprising twist at the end.", "Use a warm, humorous tone.", "Make it formal and concise.",
    "End with a question to the reader.", "Avoid using the letter 'z'.", "Start every sentence with a different word.",
    "Include at least two vivid sensory details.", "Write it as a numbered list.", "Use simple words only.",
    "", "", "",
)
PERSONAS = (
    ("a pirate captain", "a new crew member asks how to survive the first storm"),
    ("Sherlock Holmes", "someone asks how you knew they had just returned from a trip"),
    ("a medieval knight", "a villager asks why you became a knight"),
    ("a friendly librarian", "a teenager asks for a book that will make them love reading"),
    ("a personal fitness coach", "a client says they have no time to exercise"),
    ("a travel agent", "a couple wants a cheap two-week honeymoon"),
    ("a stand-up comedian", "the audience asks about your worst job ever"),
    ("a customer support agent for an internet provider", "a customer's connection drops every evening"),
    ("an astronaut on the International Space Station", "a school class asks what you eat"),
    ("a wise old tree", "a child asks what the forest was like long ago"),
    ("a nutritionist", "someone wants to stop snacking late at night"),
    ("a detective in 1920s Chicago", "a nervous witness walks into your office"),
    ("a tour guide in ancient Rome", "a visitor asks what to see first"),
    ("a math tutor", "a student says fractions make no sense"),
    ("a chef in a busy kitchen", "a new cook burns the sauce during dinner service"),
    ("a career counselor", "a graduate cannot choose between two job offers"),
    ("a spaceship's onboard computer", "the crew asks why the engines stopped"),
    ("a museum curator", "a visitor asks why a blank canvas is worth millions"),
    ("a sports commentator", "the final seconds of a tied basketball game"),
    ("a kind grandmother", "a grandchild is nervous before an exam"),
    ("a startup founder pitching to investors", "an investor asks why your idea will work"),
    ("a park ranger", "hikers ask what to do if they meet a bear"),
    ("Shakespeare", "someone asks your opinion of modern text messages"),
    ("a time-travelling historian", "someone asks what surprised you most about the year 1500"),
)
PERSONA_QUESTIONS = (
    "Describe a typical day for you.", "What is the hardest part of what you do?",
    "Give advice to someone who wants to follow in your footsteps.", "Tell me about the most memorable moment of your life.",
    "What do people usually misunderstand about you?", "What would you change about the world if you could?",
    "Introduce yourself to a group of strangers.", "What is your favorite tool or possession, and why?",
    "How do you handle a bad day?", "What does success mean to you?",
)
CONCEPTS = (
    "photosynthesis", "natural selection", "the water cycle", "supply and demand", "inflation", "compound interest",
    "plate tectonics", "black holes", "the theory of relativity", "quantum entanglement", "entropy", "DNA replication",
    "the immune system", "vaccines", "antibiotic resistance", "the greenhouse effect", "ocean currents",
    "electric circuits", "magnetism", "Newton's laws of motion", "the Doppler effect", "nuclear fission",
    "chemical bonding", "pH and acidity", "catalysts", "the periodic table", "cell division", "neurons and synapses",
    "machine learning", "public-key cryptography", "how the internet routes data", "databases and indexing",
    "recursion", "binary numbers", "sorting algorithms", "operating systems", "compilers", "blockchain",
    "the French Revolution", "the Industrial Revolution", "the Renaissance", "the Cold War", "the Silk Road",
    "ancient Egyptian pyramids", "the Roman Republic", "the printing press", "colonialism", "the civil rights movement",
    "democracy", "the separation of powers", "utilitarianism", "Stoicism", "existentialism", "the social contract",
    "cognitive dissonance", "confirmation bias", "opportunity cost", "comparative advantage", "game theory",
    "impressionism in painting", "the hero's journey", "satire", "the sonnet form", "Greek tragedy", "minimalism",
    "the scientific method", "statistical significance", "correlation versus causation", "probability",
    "the Pythagorean theorem", "derivatives in calculus", "prime numbers", "exponential growth", "climate models",
)
COMPARISONS = (
    ("weather", "climate"), ("viruses", "bacteria"), ("mitosis", "meiosis"), ("stocks", "bonds"),
    ("renting", "buying a home"), ("Python", "JavaScript"), ("TCP", "UDP"), ("RAM", "storage"),
    ("socialism", "capitalism"), ("a republic", "a direct democracy"), ("nuclear power", "solar power"),
    ("speed", "velocity"), ("mass", "weight"), ("empathy", "sympathy"), ("ethics", "morals"),
    ("baroque music", "classical music"), ("a simile", "a metaphor"), ("fission", "fusion"),
    ("an epidemic", "a pandemic"), ("machine learning", "traditional programming"), ("lakes", "ponds"),
)
QUESTION_FORMS = (
    "Explain {c} to {a}.", "What is {c}, and why does it matter?", "Give three real-world examples of {c}.",
    "What are common misconceptions about {c}?", "Describe {c} in simple terms, then add one deeper detail.",
    "How would you teach {c} in a ten-minute lesson?", "Summarize the key ideas of {c} in five bullet points.",
    "Write a short quiz with answers about {c}.", "What questions are still open about {c}?",
)
NAMES = (
    "Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam", "Maya",
    "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yusuf", "Zoe",
)
ITEMS = (
    ("apples", 0.5), ("notebooks", 2.25), ("pencils", 0.4), ("tickets", 12.0), ("muffins", 1.75),
    ("books", 9.5), ("plants", 6.0), ("shirts", 15.0), ("coffees", 3.2), ("batteries", 1.1),
)
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Toronto", "Vienna", "Perth", "Denver", "Cairo")
PASSAGE_TASKS = (
    "Summarize the following passage in three sentences.",
    "Rewrite the following passage in plain modern English.",
    "List every person or character named in the following passage and say what each one does.",
    "What is the mood of the following passage? Support your answer with two quotations.",
    "Explain the meaning of the following lines to a high school student.",
    "Write five discussion questions about the following passage.",
    "Extract every place name and every date or time mentioned in the following passage as a JSON object.",
    "Identify two literary devices used in the following passage and explain their effect.",
    "Continue the following passage for one more paragraph in the same style.",
    "Turn the following passage into a short modern news report.",
)


def _writing(rng: random.Random) -> str:
    form, topic = rng.choice(FORMS), rng.choice(TOPICS)
    text = f"Write a {form} about {topic}."
    if rng.random() < 0.4:
        text += f" The audience is {rng.choice(AUDIENCES)}."
    constraint = rng.choice(CONSTRAINTS)
    return f"{text} {constraint}".strip()


def _rewrite(rng: random.Random) -> str:
    form, topic = rng.choice(FORMS), rng.choice(TOPICS)
    styles = ("as a haiku", "for a five-year-old", "in the style of a sports commentary", "as a formal memo",
              "in one sentence", "with more suspense")
    return (f"Draft a {form} about {topic}, then rewrite it {rng.choice(styles)}. "
            "Show both versions with headings.")


def _roleplay(rng: random.Random) -> str:
    persona, situation = rng.choice(PERSONAS)
    if rng.random() < 0.5:
        situation = rng.choice(PERSONA_QUESTIONS)
        return f"{rng.choice(('Pretend you are {p}.', 'Act as {p}.')).format(p=persona)} {situation}"
    opener = rng.choice(("Pretend you are {p}.", "Act as {p}.", "You are {p}. Stay in character.",
                         "Take on the role of {p} for this conversation."))
    return f"{opener.format(p=persona)} {situation[0].upper()}{situation[1:]}. How do you respond?"


def _stem_humanities(rng: random.Random) -> str:
    if rng.random() < 0.25:
        left, right = rng.choice(COMPARISONS)
        return rng.choice((f"What is the difference between {left} and {right}?",
                           f"Compare {left} and {right} in a short table, then explain when each matters.",
                           f"People often confuse {left} and {right}. Clear up the confusion with examples."))
    return rng.choice(QUESTION_FORMS).format(c=rng.choice(CONCEPTS), a=rng.choice(AUDIENCES))


def _arithmetic_story(rng: random.Random) -> str:
    name, (item, price) = rng.choice(NAMES), rng.choice(ITEMS)
    count, paid = rng.randint(3, 24), rng.choice((20, 50, 100))
    discount = rng.choice((0, 10, 15, 20, 25))
    text = f"{name} buys {count} {item} at ${price:.2f} each"
    text += f" with a {discount}% discount on the total." if discount else "."
    return f"{text} {name} pays with a ${paid} bill. How much change does {name} get? Show your steps."


def _algebra(rng: random.Random) -> str:
    a, b, x = rng.randint(2, 12), rng.randint(-20, 20), rng.randint(-9, 15)
    c = a * x + b
    if rng.random() < 0.5:
        return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}. Explain each step."
    p, q = rng.randint(1, 9), rng.randint(1, 9)
    s, t = rng.randint(2, 5), rng.randint(2, 5)
    return (f"Solve the system of equations: {s}x + {t}y = {s * p + t * q} and x - y = {p - q}. "
            "Check your answer.")


def _geometry(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(3, 20), rng.randint(3, 20)
        return f"A right triangle has legs of length {a} and {b}. What is its hypotenuse, area and perimeter?"
    if kind == 1:
        r = rng.randint(2, 30)
        return f"A circular garden has a radius of {r} meters. How much fencing and how much soil area does it need?"
    if kind == 2:
        pts = [(rng.randint(-5, 8), rng.randint(-5, 8)) for _ in range(3)]
        return f"What is the area of the triangle with vertices at {pts[0]}, {pts[1]} and {pts[2]}?"
    w, h, d = rng.randint(2, 15), rng.randint(2, 15), rng.randint(2, 15)
    return f"A box measures {w} cm by {h} cm by {d} cm. Find its volume and surface area."


def _probability(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        total = rng.randint(3, 12)
        return f"Two fair six-sided dice are rolled. What is the probability that the sum is {total}?"
    if kind == 1:
        red, blue = rng.randint(2, 9), rng.randint(2, 9)
        return (f"A bag holds {red} red and {blue} blue marbles. Two are drawn without replacement. "
                "What is the probability that both are the same color?")
    flips, heads = rng.randint(3, 8), rng.randint(1, 3)
    return f"A fair coin is flipped {flips} times. What is the probability of getting at least {heads} heads?"


def _rates(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        speed, hours = rng.randint(40, 120), rng.randint(2, 7)
        origin, destination = rng.sample(CITIES, 2)
        return (f"A train leaves {origin} at {speed} km/h and travels for {hours} hours to {destination}, then returns "
                f"{rng.randint(10, 30)} km/h faster. What is the average speed for the round trip?")
    if kind == 1:
        principal, rate, years = rng.choice((1000, 2500, 5000, 12000)), rng.randint(2, 9), rng.randint(2, 10)
        return (f"${principal} is invested at {rate}% interest compounded yearly for {years} years. "
                "How much is it worth, and how much more is that than simple interest?")
    if kind == 2:
        first, second = rng.randint(2, 9), rng.randint(3, 12)
        return (f"{rng.choice(NAMES)} can paint a fence in {first} hours and {rng.choice(NAMES)} can paint it in {second} "
                "hours. How long does it take them working together?")
    scores = [rng.randint(55, 100) for _ in range(rng.randint(4, 7))]
    return (f"A student's test scores are {', '.join(map(str, scores))}. What are the mean, median and range? "
            "What score on the next test would raise the mean to 85?")


def _sequence(rng: random.Random) -> str:
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    if rng.random() < 0.5:
        terms = [start + step * i for i in range(5)]
        return f"Find the next three terms and a formula for the sequence {', '.join(map(str, terms))}, ..."
    terms = [start * step**i for i in range(4)]
    return f"What is the sum of the first 10 terms of the sequence {', '.join(map(str, terms))}, ...?"


def _ordering_puzzle(rng: random.Random) -> str:
    order = rng.sample(NAMES, rng.randint(3, 5))
    comparative, most, least = rng.choice((("taller", "tallest", "shortest"), ("older", "oldest", "youngest"),
                                           ("faster", "fastest", "slowest"), ("heavier", "heaviest", "lightest")))
    facts = [f"{order[i]} is {comparative} than {order[i + 1]}" for i in range(len(order) - 1)]
    rng.shuffle(facts)
    return f"{'; '.join(facts)}. Who is the {rng.choice((most, least))}? Explain your reasoning."


def _logic(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return _ordering_puzzle(rng)
    if kind == 1:
        day = rng.choice(("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"))
        return f"If today is {day}, what day of the week will it be in {rng.randint(10, 400)} days? Show the reasoning."
    if kind == 2:
        a, b = rng.sample(NAMES, 2)
        relation = rng.choice(("mother's brother", "father's sister's son", "sister's daughter", "husband's father"))
        return f"{a} is {b}'s {relation}. How is {b} related to {a}? Explain briefly."
    animals = rng.sample(("cats", "dogs", "birds", "fish", "horses", "rabbits"), 3)
    return (f"All {animals[0]} in the village are friendly. Some friendly animals are {animals[1]}. "
            f"No {animals[2]} are friendly. Which conclusions follow for certain, and which do not?")


def _records(rng: random.Random) -> str:
    rows = []
    for name in rng.sample(NAMES, rng.randint(3, 6)):
        rows.append(f"{name}, {rng.randint(19, 70)}, {rng.choice(CITIES)}, joined {rng.randint(2005, 2025)}")
    task = rng.choice((
        "Convert these records (name, age, city, year joined) into a JSON list of objects.",
        "From these records (name, age, city, year joined), who joined earliest and what is the average age?",
        "Turn these records (name, age, city, year joined) into a Markdown table sorted by age.",
    ))
    return task + "\n\n" + "\n".join(rows)


BUILDERS: dict[str, tuple[float, Callable[[random.Random], str]]] = {
    "writing": (0.20, _writing),
    "rewrite": (0.05, _rewrite),
    "roleplay": (0.12, _roleplay),
    "stem_humanities": (0.20, _stem_humanities),
    "arithmetic": (0.06, _arithmetic_story),
    "algebra": (0.05, _algebra),
    "geometry": (0.04, _geometry),
    "probability": (0.03, _probability),
    "rates": (0.04, _rates),
    "sequence": (0.02, _sequence),
    "logic": (0.09, _logic),
    "records": (0.04, _records),
}


def text_passages(texts: Iterable[str], *, min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Paragraph groups of `min_chars`..`max_chars` characters from plain texts (Project Gutenberg headers and
    licence text skipped when their markers are present)."""
    passages: list[str] = []
    for text in texts:
        start = re.search(r"\*\*\* ?START OF .*?\*\*\*", text)
        end = re.search(r"\*\*\* ?END OF ", text)
        body = text[start.end() if start else 0 : end.start() if end else len(text)]
        current: list[str] = []
        for block in re.split(r"\n\s*\n", body):
            block = block.strip("\n")
            if not block.strip():
                continue
            current.append(block)
            size = sum(len(b) for b in current)
            if size >= min_chars:
                if size <= max_chars:
                    passages.append("\n\n".join(current))
                current = []
    return passages


def task_prompts(count: int, *, seed: int = 0, passages: list[str] | None = None,
                 passage_share: float = 0.15) -> list[str]:
    """`count` distinct requests (fewer if the generators run out of new ones), mixed by the weights in
    BUILDERS; a `passage_share` of them are tasks over `passages` when any are given."""
    rng = random.Random(seed)
    names = list(BUILDERS)
    weights = [BUILDERS[name][0] for name in names]
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < count and attempts < count * 20:
        attempts += 1
        if passages and rng.random() < passage_share:
            prompt = f"{rng.choice(PASSAGE_TASKS)}\n\n{rng.choice(passages)}"
        else:
            builder = BUILDERS[rng.choices(names, weights)[0]][1]
            prompt = builder(rng)
        seen.setdefault(prompt, None)
    return list(seen)


def passages_from_files(paths: Iterable[Path]) -> list[str]:
    return text_passages(path.read_text(encoding="utf-8", errors="replace") for path in sorted(paths))
