"""Instruction templates and fillers for the training prompts (written for spekit; no benchmark text)."""
from __future__ import annotations

import random

FOLLOW_UPS = [
    "Now rewrite your answer in three sentences.", "Explain that to a ten-year-old.",
    "Give one more example.", "Turn your answer into a bulleted list.", "What is the weakest point of your answer?",
    "Rewrite it in a more formal tone.", "Summarise your answer in one sentence.",
    "Can you make it shorter and add a title?", "Now do the same, but for a different audience: engineers.",
    "Which part of this would you check first, and why?", "Add a short conclusion.",
    "Translate the first paragraph of your answer into French.",
]

# --- coding
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go", "SQL", "Bash"]
CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts the frequency of each word in a text file", "finds the second largest number in a list",
    "removes duplicates from a list while keeping the order", "computes the n-th Fibonacci number iteratively",
    "parses a CSV file and prints the average of one column", "validates an email address",
    "implements binary search", "flattens a nested list", "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings", "rotates a matrix by 90 degrees",
    "implements a stack with push, pop and peek", "implements a queue using two stacks",
    "checks whether brackets in a string are balanced", "computes the greatest common divisor of two numbers",
    "lists all prime numbers below n with a sieve", "reads a JSON file and prints its keys",
    "groups a list of words by their anagrams", "implements an LRU cache", "computes the median of a stream",
    "finds the shortest path in a grid with breadth-first search", "counts vowels in a string",
    "sorts a list of dictionaries by a key", "converts a temperature between Celsius and Fahrenheit",
    "downloads nothing but simulates a retry loop with exponential backoff", "tokenizes an arithmetic expression",
    "evaluates a postfix expression", "checks whether two strings are anagrams", "transposes a matrix",
    "finds all pairs in a list that sum to a target", "computes a running average", "chunks a list into batches",
    "formats a number of seconds as hours, minutes and seconds", "implements insertion sort",
    "implements merge sort", "finds the mode of a list", "counts lines, words and characters in a file",
]
CODE_ASKS = [
    "Write a {lang} function that {task}.", "Implement a program in {lang} that {task}. Explain your approach.",
    "Write {lang} code that {task}, and add a few test cases.",
    "How would you write a function in {lang} that {task}? Give the code and its time complexity.",
]
FUNCTION_ASKS = [
    "Explain what the following function `{name}` from Python's `{module}` module does.",
    "Write a clear docstring for this function.", "Summarise this Python function in two sentences.",
    "Rewrite this function so that it is easier to read, keeping its behaviour.",
    "Write three unit tests for the function `{name}` below.", "Describe, step by step, how this code works.",
    "What are the inputs and outputs of `{name}`? Explain with an example.",
    "Is there a bug or an edge case this function does not handle? Explain.",
    "Translate this function into plain English prose, line by line.",
    "What does `{name}` return, and when could it raise an exception?",
]

# --- writing and roleplay
FORMS = ["blog post", "short story", "poem", "email", "product description", "cover letter", "speech",
         "book review", "news article", "letter to the editor", "restaurant review", "travel guide entry",
         "motivational message", "limerick", "persuasive essay", "announcement", "diary entry", "FAQ section"]
TOPICS = ["learning to cook", "a rainy day in a small town", "the first day at a new job", "renewable energy",
          "a lost cat that finds its way home", "the benefits of reading", "a mountain hiking trip",
          "a new smartphone app for gardeners", "moving to another country", "friendship", "a local bakery",
          "remote work", "a robot that learns to paint", "saving money", "the history of bicycles",
          "a volunteer project", "ocean pollution", "a chess tournament", "starting a podcast",
          "a winter festival", "public libraries", "a science fair", "electric cars", "learning a language",
          "a family reunion", "time management", "a train journey", "city parks", "a startup that failed",
          "the night sky", "healthy sleep", "a music concert", "an old lighthouse", "urban gardening"]
AUDIENCES = ["children", "teenagers", "busy professionals", "retired people", "students", "a general audience",
             "new employees", "tourists", "software engineers", "parents"]
WRITING_ASKS = [
    "Write a {form} about {topic}.", "Compose a {form} about {topic} for {audience}.",
    "Draft a {form} of about {n} words on {topic}.", "Write an engaging {form} about {topic} aimed at {audience}.",
    "Please write a {form} about {topic}. Keep it under {n} words.",
]
ROLES = [
    ("a ship's captain", ["What do you do when a storm comes?", "Describe your crew.", "What is your favourite port?"]),
    ("a medieval blacksmith", ["How do you make a sword?", "What is a normal day like for you?"]),
    ("a detective", ["How do you solve a case?", "Tell me about the strangest case you have had."]),
    ("a personal trainer", ["How should I start exercising?", "What should I eat after a workout?"]),
    ("a museum guide", ["Tell me about the most famous painting here.", "Why are museums important?"]),
    ("a chef in a busy restaurant", ["What is your signature dish?", "How do you handle a rush?"]),
    ("an astronaut on a space station", ["What is it like to sleep in space?", "What do you miss from Earth?"]),
    ("a librarian", ["Which book should I read next?", "How do you organise so many books?"]),
    ("a travel agent", ["Plan a weekend trip for me.", "Where should I go in winter?"]),
    ("a math teacher", ["Why do we need algebra?", "How can I get better at fractions?"]),
    ("a startup founder", ["Why should I invest in your company?", "What was your biggest mistake?"]),
    ("a gardener", ["How do I keep tomatoes healthy?", "What should I plant in autumn?"]),
    ("a customer support agent", ["My order did not arrive. What can I do?", "How do I reset my password?"]),
    ("a historian", ["What caused the fall of empires?", "Which period would you visit?"]),
    ("a pirate", ["Where is your treasure?", "How did you become a pirate?"]),
    ("a doctor", ["What are common causes of headaches?", "How can I improve my sleep?"]),
]
ROLE_ASKS = ["Pretend you are {role}. {question}", "Act as {role} and answer in character: {question}",
             "You are {role}. Stay in character. {question}"]

# --- explanations
STEM = [
    ("physics", ["inertia", "entropy", "electromagnetic induction", "the Doppler effect", "nuclear fission",
                 "friction", "momentum", "superconductivity", "refraction of light", "gravitational waves"]),
    ("chemistry", ["covalent bonds", "catalysts", "pH", "oxidation and reduction", "isotopes", "polymers"]),
    ("biology", ["photosynthesis", "natural selection", "the immune system", "DNA replication", "enzymes",
                 "cell division", "the nervous system", "ecosystems"]),
    ("computer science", ["recursion", "hash tables", "public-key cryptography", "garbage collection",
                          "big-O notation", "compilers", "neural networks", "TCP and UDP", "virtual memory"]),
    ("earth science", ["plate tectonics", "the water cycle", "climate change", "volcanoes", "ocean currents"]),
    ("engineering", ["how bridges carry loads", "heat pumps", "how batteries store energy", "control systems"]),
]
HUMANITIES = [
    ("economics", ["inflation", "supply and demand", "comparative advantage", "monetary policy",
                   "opportunity cost", "unemployment", "taxes and public goods"]),
    ("history", ["the printing press", "the industrial revolution", "the Silk Road", "the Renaissance",
                 "ancient Rome's republic", "the invention of writing"]),
    ("philosophy", ["utilitarianism", "free will", "the trolley problem", "stoicism", "the social contract"]),
    ("psychology", ["cognitive biases", "motivation", "memory", "habits", "confirmation bias"]),
    ("art and literature", ["impressionism", "the hero's journey", "satire", "symbolism in poetry", "baroque music"]),
    ("politics and law", ["separation of powers", "human rights", "the rule of law", "federalism"]),
]
EXPLAIN_ASKS = ["In {field}, what is {concept}? Explain it simply.", "Explain {concept} ({field}) with an example.",
                "What is {concept}, and why does it matter in {field}?",
                "Give a short overview of {concept} for a beginner in {field}.",
                "Describe {concept} and one common misconception about it."]

# --- summarisation and passages
SUMMARY_ASKS = ["Summarize: {text}", "Summarize the following text in a few sentences.\n\n{text}",
                "Write a one-paragraph summary of this passage:\n{text}", "TL;DR: {text}"]
RAG_QUESTIONS = ["Using only the passages above, explain what they say about {term}.",
                 "Based on the text above, answer: what is the role of {term}?",
                 "According to the passages, how is {term} used? Answer briefly.",
                 "Answer from the passages: what should a programmer know about {term}?"]

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = [("apples", 0.5), ("notebooks", 3), ("pencils", 0.25), ("tickets", 12), ("books", 8), ("shirts", 15),
         ("cupcakes", 2), ("plants", 6), ("bottles of juice", 1.5), ("chairs", 40)]


def reasoning_puzzle(r: random.Random) -> str:
    a, b, c, d = r.sample(NAMES, 4)
    kind = r.randrange(5)
    if kind == 0:
        return (f"{a} is taller than {b}. {b} is taller than {c}. {d} is shorter than {c}. "
                f"Who is the tallest and who is the shortest? Explain your reasoning.")
    if kind == 1:
        n = r.randint(3, 9)
        return (f"In a race, {a} overtakes the person in position {n}. What position is {a} in now, and what "
                f"position is the person who was overtaken?")
    if kind == 2:
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        k = r.randint(2, 40)
        return f"If today is {r.choice(days)}, what day of the week will it be in {k} days? Show your steps."
    if kind == 3:
        return (f"All {r.choice(['gardeners', 'pilots', 'painters'])} in the club are members of the board. "
                f"{a} is in the club but not on the board. Can {a} be a {r.choice(['gardener', 'pilot', 'painter'])}?"
                f" Explain.")
    x, y = r.randint(2, 6), r.randint(2, 6)
    return (f"{a} has {x} sisters and each sister has {y} brothers. How many brothers does {a} have if {a} is a "
            f"boy? Think step by step.")


def math_problem(r: random.Random) -> str:
    kind = r.randrange(6)
    if kind == 0:
        a, x, b = r.randint(2, 12), r.randint(-10, 20), r.randint(-30, 30)
        return f"Solve for x: {a}x + {b} = {a * x + b}."
    if kind == 1:
        pts = [(r.randint(-5, 5), r.randint(-5, 5)) for _ in range(3)]
        return f"The vertices of a triangle are {pts[0]}, {pts[1]} and {pts[2]}. What is its area?"
    if kind == 2:
        n = r.randint(10, 200)
        return f"What is the sum of the integers from 1 to {n}? Explain the formula you use."
    if kind == 3:
        s, k = r.randint(4, 20), r.randint(2, 4)
        return f"When rolling {k} fair dice with {s} sides each, what is the probability that all show the same number?"
    if kind == 4:
        a, b = r.randint(12, 400), r.randint(12, 400)
        return f"Find the greatest common divisor and the least common multiple of {a} and {b}."
    a, b = r.randint(2, 9), r.randint(1, 20)
    return f"If f(x) = {a}x^2 - {b}x + 1, find f({r.randint(-4, 6)}) and the derivative f'(x)."


def word_problem(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    item, price = r.choice(ITEMS)
    n, m, pct = r.randint(3, 30), r.randint(2, 12), r.choice([10, 20, 25, 50])
    kind = r.randrange(5)
    if kind == 0:
        return (f"{a} buys {n} {item} at ${price} each and {m} more the next day. How much does {a} spend in "
                f"total?")
    if kind == 1:
        return (f"{a} has {n * m} {item}. {a} gives {b} {pct}% of them and shares the rest equally among {m} "
                f"friends. How many does each friend get?")
    if kind == 2:
        h = r.randint(2, 9)
        return (f"A train travels {n * 10} km in {h} hours, then {m * 10} km in {h + 1} hours. What is its "
                f"average speed for the whole trip?")
    if kind == 3:
        return (f"{a} earns ${n * 5} a week and saves {pct}% of it. How many weeks does {a} need to save "
                f"${n * 5 * m}?")
    return (f"{a} is {n} years old. {b} is {m} years older than {a}. In {r.randint(2, 10)} years, what will be "
            f"the sum of their ages?")


def extraction_task(r: random.Random) -> str:
    people = r.sample(NAMES, 3)
    cities = r.sample(["Lisbon", "Oslo", "Nairobi", "Lima", "Seoul", "Toronto", "Krakow", "Hanoi"], 3)
    lines = [f"{p} from {c} ordered {r.randint(1, 9)} {r.choice(ITEMS)[0]} on {r.randint(1, 28)} "
             f"{r.choice(['March', 'June', 'October'])} {r.randint(2018, 2025)} for ${r.randint(5, 900)}."
             for p, c in zip(people, cities)]
    ask = r.choice(["Extract the names, cities, dates and amounts from the text below as a JSON list.",
                    "From the following records, make a table with the columns name, city, date, amount.",
                    "Who spent the most in the text below, and on what date? Answer in one line.",
                    "List every city mentioned below together with the person from there."])
    return ask + "\n" + "\n".join(lines)


# --- translation: sentences assembled from phrase lists (subject, verb phrase, time)
PHRASES = {
    "German": (["Meine Schwester", "Der Lehrer", "Unsere Nachbarn", "Das Unternehmen", "Die Stadtverwaltung",
                "Ein junger Arzt"],
               ["kauft ein neues Auto", "arbeitet an einem großen Projekt", "besucht das Museum",
                "plant eine Reise nach Italien", "liest ein spannendes Buch", "eröffnet ein kleines Café",
                "baut einen neuen Bahnhof", "spricht über die Zukunft der Energie"],
               ["heute", "am Wochenende", "seit drei Jahren", "im nächsten Sommer", "jeden Morgen"]),
    "French": (["Mon frère", "La directrice", "Les étudiants", "Le gouvernement", "Une amie"],
               ["prépare le dîner", "cherche un nouvel appartement", "visite la vieille ville",
                "écrit une lettre importante", "apprend à jouer du piano"],
               ["aujourd'hui", "ce week-end", "depuis longtemps", "l'année prochaine"]),
    "Spanish": (["Mi abuela", "El equipo", "Los vecinos", "La empresa", "Un periodista"],
                ["cocina una paella", "construye una casa nueva", "viaja a la costa", "publica un informe",
                 "estudia para el examen"],
                ["hoy", "el fin de semana", "desde hace años", "el próximo mes"]),
}


SOURCE_LANGUAGES = ["German", "German", "French", "Spanish"]          # drawn uniformly: German half the time
# the template sentences take the first three asks (their files stay as they were); catalog sentences take all four
TRANSLATE_ASKS = ["Translate {lang} to English: {text}", "Translate into English: {text}",
                  "What does this {lang} text mean in English? {text}", "Please translate from {lang}:\n{text}"]


def translation_task(r: random.Random) -> str:
    lang = r.choice(SOURCE_LANGUAGES)
    subjects, verbs, times = PHRASES[lang]
    n = r.randint(1, 2)
    text = " ".join(f"{r.choice(subjects)} {r.choice(verbs)} {r.choice(times)}." for _ in range(n))
    return r.choice(TRANSLATE_ASKS[:3]).format(lang=lang, text=text)


QA = [
    ("What is the capital of {x}?", ["France", "Japan", "Kenya", "Canada", "Peru", "Norway", "Egypt", "Vietnam",
                                     "Australia", "Poland", "Chile", "Morocco"]),
    ("Who wrote {x}?", ["Pride and Prejudice", "Hamlet", "Don Quixote", "War and Peace", "The Odyssey",
                        "Frankenstein", "Moby-Dick", "One Hundred Years of Solitude"]),
    ("What is {x} used for?", ["a barometer", "a compass", "a thermostat", "a spreadsheet", "a router",
                               "a microscope", "a transformer in power grids", "a seismograph"]),
    ("Which planet is {x}?", ["the largest in the solar system", "closest to the sun", "known as the red planet",
                              "famous for its rings"]),
    ("How many {x}?", ["bones are in the adult human body", "players are on a football team",
                       "continents are there", "days are in a leap year", "sides does a hexagon have"]),
    ("When did {x} happen?", ["the first moon landing", "the fall of the Berlin Wall", "the French Revolution",
                              "the invention of the telephone"]),
    ("Who invented {x}?", ["the light bulb", "the telephone", "the World Wide Web", "dynamite", "the printing press"]),
    ("What does the abbreviation {x} stand for?", ["NASA", "CPU", "DNA", "GDP", "HTTP", "UNESCO", "RAM"]),
]


def short_question(r: random.Random) -> str:
    template, fillers = r.choice(QA)
    return template.format(x=r.choice(fillers))
