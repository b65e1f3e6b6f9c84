"""The training prompt set: templated prompts over the benchmark suite's nine task types,
written for training and kept apart from the suite (never a public benchmark prompt).

Each category combines a few request templates with fillers; the combinations are
enumerated in a fixed order and interleaved, so ``training_prompts(n)`` is deterministic
and its first n prompts cover every category evenly. Summaries and extractions read
passages of text: invented news reports written here, and module docstrings of the Python
standard library. Prompt ids are positions in this order: adding templates renumbers
them (`train data` refuses to resume answers to an earlier version).

After the templated prompts come the written ones (``data/training_prompts.jsonl``): a
hundred requests per category written by hand for training, in the many phrasings, domains
and lengths real users send, each with its own passage where a task reads one. (A head
trained with them for 55 minutes drafted no better on the suite than the shipped head
trained on the templated ones alone for 75: docs/training.md.)
"""

from __future__ import annotations

import ast
import itertools
import json
import sysconfig
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

from ..prompts import categories_in_turn

CATEGORIES = ("code", "creative", "extraction", "json", "math", "open_qa", "summarization", "template", "translation")

_FUNCTIONS = [
    ("count_vowels(text)", "returns how many vowels a string contains"),
    ("flatten(nested)", "flattens a list of lists one level deep"),
    ("chunk(items, size)", "splits a list into consecutive chunks of at most `size` items"),
    ("is_prime(n)", "tells whether an integer is prime"),
    ("merge_dicts(a, b)", "merges two dicts, summing the values of keys present in both"),
    ("rotate(items, k)", "rotates a list k places to the right"),
    ("word_frequencies(text)", "counts how often each lower-cased word occurs"),
    ("running_mean(values)", "returns the mean of every prefix of a list of numbers"),
    ("dedupe(items)", "removes duplicates from a list while keeping the first occurrence order"),
    ("parse_duration(text)", "turns strings like '1h30m' or '45s' into a number of seconds"),
    ("binary_search(items, target)", "finds the index of target in a sorted list, or -1"),
    ("transpose(matrix)", "transposes a list of equal-length lists"),
    ("slugify(title)", "turns a title into a lower-case URL slug with hyphens"),
    ("caesar(text, shift)", "applies a Caesar cipher to the letters of a string"),
    ("group_by(items, key)", "groups a list of dicts into a dict of lists by one key"),
    ("fibonacci(n)", "returns the first n Fibonacci numbers"),
    ("median(values)", "returns the median of a non-empty list of numbers"),
    ("roman_to_int(text)", "converts a Roman numeral to an integer"),
    ("invert_dict(mapping)", "swaps the keys and values of a dict"),
    ("read_csv_rows(path)", "reads a CSV file into a list of dicts keyed by the header"),
    ("retry(func, attempts)", "calls a function until it succeeds or the attempts run out"),
    ("camel_to_snake(name)", "converts a camelCase identifier to snake_case"),
    ("histogram(values, bins)", "counts how many values fall into each of `bins` equal-width bins"),
    ("validate_email(text)", "checks whether a string looks like an email address"),
    ("lru_cache_dict(capacity)", "returns a small least-recently-used cache class"),
    ("matrix_multiply(a, b)", "multiplies two matrices given as lists of lists"),
    ("pairwise_sums(items)", "returns the sums of every adjacent pair in a list"),
    ("top_k(items, k)", "returns the k largest items of a list in descending order"),
]
_CODE_TEMPLATES = [
    "Write a Python function `{sig}` that {what}. Include a docstring.",
    "Implement `{sig}` in Python: it {what}. Add type hints and one usage example.",
    "In JavaScript, write a function equivalent to Python's `{sig}`, which {what}.",
    "Write pytest tests for a Python function `{sig}` that {what}.",
    "Explain step by step how you would write `{sig}`, a function that {what}, then give the code.",
    "Write `{sig}` in Python, which {what}, and explain its time complexity.",
    "Here is a task: `{sig}` {what}. Write the function and a short README section describing it.",
    "Write a Python function `{sig}` that {what}, then refactor it to be shorter.",
]

_CREATIVE_SUBJECTS = ["a beekeeper at dusk", "a lost umbrella", "the first snow of the year", "a robot learning to paint",
                      "an old bridge", "a city at 4 a.m.", "a letter never sent", "a garden on a balcony",
                      "a train that runs late", "the sound of rain on a tin roof", "a chess game in a park", "a new library"]
_CREATIVE_SUBJECTS += ["a fox crossing a frozen lake", "an astronaut's last day on the station", "a bakery before dawn",
                       "a village festival", "a forgotten violin", "a dog waiting at a station", "the end of summer",
                       "a storm at sea", "a clockmaker's shop", "two old friends meeting again", "a mountain hut",
                       "a kite caught in a tree", "a night market", "the first day at a new school",
                       "a message in a bottle", "a beekeeper's morning"]
_CREATIVE_TEMPLATES = [
    "Write a short poem about {s}.",
    "Write a four-sentence story about {s}.",
    "Describe {s} in one vivid paragraph.",
    "Write a haiku about {s}, then explain its image in one sentence.",
    "Write the opening paragraph of a novel that begins with {s}.",
    "Write a short dialogue inspired by {s}.",
    "Write a limerick about {s}.",
    "Write a diary entry from the point of view of someone who sees {s}.",
]

_PEOPLE = [("Maria Lopez", "Lisbon", "a civil engineer", 1987), ("Kenji Watanabe", "Osaka", "a pastry chef", 1975),
           ("Amara Okafor", "Lagos", "a data analyst", 1992), ("Tomas Novak", "Brno", "a violin maker", 1969),
           ("Lea Schmidt", "Hamburg", "a ferry captain", 1981), ("Ravi Menon", "Kochi", "a school principal", 1978),
           ("Sofia Rossi", "Turin", "a bicycle mechanic", 1995), ("Oliver Grant", "Leeds", "a museum curator", 1964),
           ("Ines Duarte", "Porto", "a radio host", 1990), ("Youssef Haddad", "Tunis", "a pharmacist", 1983),
           ("Hanna Virtanen", "Tampere", "a glass blower", 1972), ("Diego Vargas", "Cusco", "a mountain guide", 1988)]
_PEOPLE += [("Aiko Tanaka", "Sapporo", "a ski instructor", 1993), ("Lukas Berger", "Graz", "a carpenter", 1979),
            ("Nadia Rahman", "Dhaka", "a software tester", 1991), ("Pierre Morel", "Lyon", "a bus driver", 1966),
            ("Grace Mensah", "Accra", "a nurse", 1985), ("Mateo Silva", "Montevideo", "a photographer", 1998),
            ("Elif Demir", "Izmir", "a marine biologist", 1986), ("Jonas Lind", "Uppsala", "a librarian", 1974),
            ("Priya Nair", "Pune", "an architect", 1989), ("Samuel Cohen", "Haifa", "a tailor", 1962),
            ("Olga Petrova", "Kazan", "a chess coach", 1980), ("Ahmed Saleh", "Alexandria", "a fisherman", 1971),
            ("Chloe Martin", "Quebec City", "a translator", 1994), ("Bruno Costa", "Recife", "a chemist", 1983),
            ("Mei Lin", "Taichung", "a tea farmer", 1968), ("Patrick Byrne", "Galway", "a sound engineer", 1990)]
_EXTRACTION_TEMPLATES = [
    "From this note, extract the person's name, city and year of birth as a list:\n\n{bio}",
    "What is the profession of the person described here? Answer in a few words.\n\n{bio}",
    "Read the text and list every proper noun in it:\n\n{passage}",
    "From the following documentation, list the functions or classes it mentions:\n\n{passage}",
    "Extract the main purpose of this module in one sentence:\n\n{passage}",
    "Extract every year and number mentioned in this text, one per line:\n\n{bio}",
    "Answer with a single word: in which city does the person described here live?\n\n{bio}",
    "From this documentation, extract the names of any parameters or options as a bullet list:\n\n{passage}",
]

_JSON_THINGS = [("a museum", "name, city, opened, collections"), ("a laptop", "brand, model, ram_gb, price_eur"),
                ("a city", "name, country, population, landmarks"), ("a library loan", "title, borrower, due_date, renewals"),
                ("a flight", "number, origin, destination, departure_time"), ("an employee", "name, role, team, start_date"),
                ("a movie", "title, director, year, rating"), ("a mountain", "name, height_m, country, first_ascent"),
                ("a song", "title, artist, album, length_seconds"), ("a hotel", "name, stars, rooms, amenities"),
                ("a course", "code, title, credits, prerequisites"), ("a bike", "maker, gears, weight_kg, frame")]
_JSON_THINGS += [("a restaurant", "name, cuisine, rating, open_days"), ("a phone", "brand, model, storage_gb, colors"),
                 ("a bus route", "number, stops, first_departure, last_departure"), ("a painting", "title, artist, year, museum"),
                 ("a sports team", "name, city, founded, players"), ("a bank transfer", "from_account, to_account, amount, currency"),
                 ("a user profile", "username, email, signup_date, interests"), ("a tree species", "name, height_m, leaf_type, regions"),
                 ("a video game", "title, studio, platforms, release_year"), ("a car", "make, model, year, fuel_type"),
                 ("a shopping cart", "items, subtotal, tax, total"), ("a weather forecast", "city, date, high_c, low_c"),
                 ("a podcast episode", "title, host, duration_minutes, topics"), ("a medication", "name, dose_mg, times_per_day, warnings"),
                 ("a concert", "artist, venue, date, ticket_price"), ("a network device", "hostname, ip, vendor, ports")]
_JSON_TEMPLATES = [
    "Return a JSON object describing {thing} with the keys {keys}. Output only JSON.",
    "Give a JSON array of three objects, each describing {thing} with keys {keys}.",
    "Write a JSON Schema for {thing} with the properties {keys}.",
    "Convert this description to JSON with keys {keys}: {thing}, invented but plausible values.",
    "Produce a JSON object for {thing} (keys: {keys}) and then one sentence explaining one field.",
    "Write a Python dict literal for {thing} with keys {keys}, then the same data as JSON.",
    "Return a JSON object for {thing} with keys {keys}, and nest one extra object called metadata.",
    "Describe {thing} as JSON with keys {keys}: give an example object, then say which keys are required.",
]

_MATH = [(17, 23), (48, 12), (125, 8), (64, 36), (91, 7), (250, 40), (33, 19), (144, 12), (75, 15), (210, 35), (56, 44),
         (99, 11)]
_MATH += [(36, 14), (81, 9), (150, 25), (72, 18), (120, 45), (63, 27), (28, 16), (200, 8), (45, 30), (96, 24), (54, 6),
          (360, 15), (84, 21), (132, 11), (18, 42), (240, 60)]
_MATH_TEMPLATES = [
    "What is {a} times {b}? Show your working.",
    "A bakery charges {b} cents for a roll. What do {a} rolls cost in euros? Explain.",
    "Solve for x: {a}x + {b} = {c}. Give each step.",
    "A cyclist rides {a} km in {b} minutes. How fast is that in km/h?",
    "Find the greatest common divisor of {a} and {b}, showing the Euclidean algorithm.",
    "What is {a} divided by {b}? Give the quotient and remainder and check the result.",
    "A class of {a} students is split into groups of {b}. How many full groups are there and how many students are left?",
    "What is {b} percent of {a}? Explain the calculation.",
]

_TOPICS = ["photosynthesis", "how the heart pumps blood", "why the sea is salty", "what a compiler does",
           "how tides work", "the water cycle", "what a mortgage is", "how a hash table works",
           "how a microwave oven heats food", "how GPS finds a position", "what a black hole is",
           "how bread rises"]
_TOPICS += ["how a bicycle stays upright", "what DNA does", "how earthquakes happen", "how a battery stores energy",
            "what a database index is", "how bees make honey", "why we dream", "how the internet routes a message",
            "what causes thunder", "how a loan's interest works", "why the moon has phases", "how recycling works",
            "what an algorithm is", "how muscles grow", "why salt melts ice", "how a camera lens focuses light"]
_QA_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "In three sentences, what is {t}?",
    "What are common misconceptions about {t}?",
    "Give a short, accurate explanation of {t} and one example.",
    "Why does {t} matter in everyday life?",
    "Write a short FAQ with three questions and answers about {t}.",
    "Compare two ways of explaining {t}, and say which is clearer.",
    "List five facts about {t}.",
]

_SUMMARY_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{passage}",
    "Write a one-sentence summary of this documentation:\n\n{passage}",
    "Summarize the key points of this text as three bullet points:\n\n{passage}",
    "Give a short title and a summary of one sentence for this text:\n\n{passage}",
    "Explain in plain words what this text says:\n\n{passage}",
    "Summarize this text for a busy reader in at most 40 words:\n\n{passage}",
    "Rewrite this text as a short paragraph a beginner can follow:\n\n{passage}",
    "List the three most important terms in this text and explain each in one line:\n\n{passage}",
]

_EVENTS = [("a team meeting", "Thursday at 10:00"), ("a dentist appointment", "Monday at 15:30"),
           ("a product launch", "the first of March"), ("a library workshop", "Saturday morning"),
           ("a server maintenance window", "Sunday 02:00-04:00 UTC"), ("a birthday party", "Friday evening"),
           ("a job interview", "Wednesday at 9:00"), ("a school trip", "next Tuesday"),
           ("an invoice reminder", "the end of the month"), ("a conference talk", "June 12"),
           ("a flat viewing", "Thursday at 18:00"), ("a charity run", "Sunday 8:00")]
_EVENTS += [("a parents' evening", "Tuesday at 19:00"), ("a code review session", "Friday at 14:00"),
            ("a yoga class", "Monday at 7:30"), ("a book club meeting", "the last Thursday of the month"),
            ("a tax deadline", "April 30"), ("a car service", "Wednesday at 8:00"), ("a farewell lunch", "Friday at noon"),
            ("a fire drill", "Tuesday at 11:00"), ("a team offsite", "May 3-4"), ("a piano recital", "Saturday at 17:00"),
            ("a vaccination appointment", "Monday at 9:15"), ("a quarterly review", "July 1"),
            ("a neighbourhood clean-up", "Sunday at 10:00"), ("a webinar", "Thursday at 16:00 CET"),
            ("a hackathon", "the weekend of October 12"), ("a wedding rehearsal", "Friday at 18:30")]
_TEMPLATE_TEMPLATES = [
    "Write a short email inviting colleagues to {e} on {w}.",
    "Fill in this template for {e} on {w}:\nSubject: ...\nDate: ...\nDetails: ...",
    "Write a polite reminder message about {e} on {w}.",
    "Write a calendar entry for {e} on {w}, with title, time, location and notes.",
    "Write a two-line SMS confirming {e} on {w}.",
    "Fill in this form for {e} on {w}:\nEvent: [event]\nWhen: [time]\nWho: [people]\nBring: [items]",
    "Write an agenda for {e} on {w} with three numbered items.",
    "Write a short announcement for a notice board about {e} on {w}.",
]

_SENTENCES = ["The meeting has been moved to next week.", "Please close the window when you leave.",
              "The museum is free on the first Sunday of the month.", "I would like a table for two, please.",
              "The ferry to the island leaves twice a day.", "Our office will be closed on Friday.",
              "Can you recommend a good book about history?", "The recipe needs three eggs and some flour.",
              "It is going to rain this afternoon.", "Thank you for your quick reply.",
              "The children are playing in the garden.", "This road is closed for repairs."]
_SENTENCES += ["Where can I buy a ticket for the concert?", "My phone battery is almost empty.",
               "We are looking for a quiet hotel near the beach.", "The soup is too salty for me.",
               "He forgot his keys at the office again.", "The shop opens at nine in the morning.",
               "Could you speak a little more slowly?", "She has lived in this town for ten years.",
               "The flight was cancelled because of the fog.", "I need to finish this report by tomorrow.",
               "Turn left after the bakery and walk two hundred metres.", "The doctor will see you in ten minutes."]
_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
_TRANSLATION_TEMPLATES = [
    "Translate into {lang}: {s}",
    "How would you say this in {lang}? \"{s}\"",
    "Translate the following sentence into {lang} and give a word-by-word gloss: {s}",
    "Translate into {lang}, then back into English: {s}",
]


@lru_cache(maxsize=1)
def local_passages(limit: int = 96, min_chars: int = 300, max_chars: int = 1200) -> tuple[str, ...]:
    """Module docstrings of the Python standard library on this machine, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if doc and min_chars <= len(doc):
            found.append(doc[:max_chars].rsplit("\n", 1)[0] if len(doc) > max_chars else doc)
        if len(found) >= limit:
            break
    if not found:  # a Python without its sources: a fixed passage keeps the set usable
        found.append("A module provides functions for reading and writing files in a portable way. "
                     "It handles paths, permissions and temporary files, and reports errors as exceptions.")
    return tuple(found)


_REPORTS = [
    ("The {place} council", "opened a repair café", "{a} residents brought {b} broken items", "{c} percent were fixed on the spot"),
    ("A survey by the {place} cycling club", "counted riders on two bridges", "{a} riders crossed on a weekday and {b} on a Sunday",
     "the club asked for a second bike lane by {year}"),
    ("The {place} museum", "reopened after a two-year renovation", "{a} visitors came in the first week, {b} of them children",
     "entry stays free until {year}"),
    ("Farmers near {place}", "tested a new irrigation schedule", "water use fell by {c} percent across {a} hectares",
     "yields stayed within {b} kilograms per hectare of last year"),
    ("The {place} water utility", "replaced old pipes in the east district", "{a} metres of pipe were laid in {b} days",
     "leaks dropped by {c} percent by {year}"),
    ("A school in {place}", "moved its start time to nine o'clock", "attendance rose from {b} to {a} pupils a day",
     "teachers reported {c} percent fewer late arrivals"),
]
_PLACES = ["Elmford", "Port Alder", "Kestrel Bay", "Norrvik", "Santa Lucía", "Marlowe", "Brennick", "Ostwald"]


def report_passages() -> list[str]:
    """Short invented news reports (who, what, figures, outcome), written for training."""
    out = []
    for i, place in enumerate(_PLACES):
        for j, (who, did, figures, outcome) in enumerate(_REPORTS):
            a, b, c, year = 120 + 37 * i + 11 * j, 15 + 7 * j + 3 * i, 10 + (5 * i + 3 * j) % 60, 2019 + (i + j) % 8
            fill = dict(place=place, a=a, b=b, c=c, year=year)
            out.append(f"{who.format(**fill)} {did} in {year}. In the first month, {figures.format(**fill)}. "
                       f"According to the report, {outcome.format(**fill)}.")
    return out


def _category_prompts(category: str) -> list[str]:
    passages = local_passages()
    reports = report_passages()
    if category == "code":
        return [t.format(sig=s, what=w) for s, w in _FUNCTIONS for t in _CODE_TEMPLATES]
    if category == "creative":
        return [t.format(s=s) for s in _CREATIVE_SUBJECTS for t in _CREATIVE_TEMPLATES]
    if category == "extraction":
        bios = [f"{n} was born in {y} in {c}. Today {n.split()[0]} works as {p} and lives near the old town."
                for n, c, p, y in _PEOPLE]
        out = []
        for i, template in itertools.product(range(len(bios)), _EXTRACTION_TEMPLATES):
            passage = passages[i % len(passages)] if i % 2 == 0 else reports[(5 * i) % len(reports)]
            out.append(template.format(bio=bios[i], passage=passage))
        return out
    if category == "json":
        return [t.format(thing=th, keys=k) for th, k in _JSON_THINGS for t in _JSON_TEMPLATES]
    if category == "math":
        return [t.format(a=a, b=b, c=a * 3 + b) for a, b in _MATH for t in _MATH_TEMPLATES]
    if category == "open_qa":
        return [t.format(t=topic) for topic in _TOPICS for t in _QA_TEMPLATES]
    if category == "summarization":
        texts = [text for pair in zip(passages[:14], reports[::3]) for text in pair]  # docs and reports in turn
        return [t.format(passage=p) for p in texts for t in _SUMMARY_TEMPLATES]
    if category == "template":
        return [t.format(e=e, w=w) for e, w in _EVENTS for t in _TEMPLATE_TEMPLATES]
    if category == "translation":
        return [t.format(lang=lang, s=s) for i, s in enumerate(_SENTENCES)
                for lang in (_LANGUAGES[i % 5], _LANGUAGES[(i + 2) % 5]) for t in _TRANSLATION_TEMPLATES]
    raise ValueError(f"unknown category {category!r}")


def _prompts_per_filler(category: str) -> int:
    """A templated category's prompts per filler (a function, a subject, a passage...):
    ``_category_prompts`` lists each filler's prompts together, one per template."""
    templates = {"code": _CODE_TEMPLATES, "creative": _CREATIVE_TEMPLATES, "extraction": _EXTRACTION_TEMPLATES,
                 "json": _JSON_TEMPLATES, "math": _MATH_TEMPLATES, "open_qa": _QA_TEMPLATES,
                 "summarization": _SUMMARY_TEMPLATES, "template": _TEMPLATE_TEMPLATES,
                 "translation": _TRANSLATION_TEMPLATES}[category]
    return len(templates) * (2 if category == "translation" else 1)  # a sentence goes into two languages


HELD_OUT_UNIT = 2  # which unit of every ``every`` is held out: an early one, so a run over a category's
                  # first few fillers (`train data --prompts 1000`, a test's 40 prompts) holds some out


def held_out(prompt_id: str, every: int = 20) -> bool:
    """Whether a training prompt is kept for evaluation: of a category's written prompts one
    in ``every``, and of its templated prompts every prompt of one filler in ``every``.
    Found in review: held out by position, each held-out templated prompt's filler (its
    passage, function or topic) was trained under the other templates, and the reported
    held-out agreement measured the templates being learned. Ids of another form: not held out."""
    kind, _, rest = prompt_id.partition("-")
    category, _, number = rest.rpartition("-")
    if kind not in ("written", "train") or not number.isdigit() or category not in CATEGORIES:
        return False  # found in a mutation audit: "custom-code-016" was held out as a templated prompt
    unit = int(number) if kind == "written" else int(number) // _prompts_per_filler(category)
    return unit % every == HELD_OUT_UNIT


@lru_cache(maxsize=1)
def written_prompts() -> dict[str, list[str]]:
    """The hand-written training requests, by category, in file order."""
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    text = files("specdecode.data").joinpath("training_prompts.jsonl").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["category"]].append(record["prompt"])
    return out


def _interleaved(per_category: dict[str, list[str]], prefix: str) -> list[dict]:
    return categories_in_turn([{"id": f"{prefix}-{category}-{index:03d}", "category": category, "prompt": prompt}
                               for category in CATEGORIES for index, prompt in enumerate(per_category[category])])


def training_prompts(count: int | None = None) -> list[dict]:
    """Up to ``count`` prompts (all if None): the templated ones, then the written ones,
    categories interleaved within each: [{"id": "train-code-000", "category": "code",
    "prompt": ...}, ..., {"id": "written-code-000", ...}, ...]."""
    prompts = _interleaved({c: _category_prompts(c) for c in CATEGORIES}, "train")
    prompts += _interleaved(written_prompts(), "written")
    return prompts if count is None else prompts[:count]
