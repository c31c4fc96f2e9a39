"""Seed prompts for the kinds of request ShareGPT has few of, for the target to answer itself (self-distillation).

    python -m trainers.seed_prompts                       # rewrites data/prompts/seed_kinds.jsonl
    python -m trainers.seed_prompts --out FILE --seed 1   # another draw of the same templates
    python -m trainers.seed_prompts --set 2               # rewrites data/prompts/seed_kinds2.jsonl

Kinds (the `category` of each line): short factual questions (`qa`), `translation`, `summarization` of a given
text, answering from a given passage (`rag`), step-by-step `math`, `extraction` of fields from a given text, and
`roleplay`. About a fifth of the prompts have a second user turn, answered by the target after its own first answer.
The second set (`--set 2`, data/prompts/seed_kinds2.jsonl, templates only, no ShareGPT) holds the other kinds of the
held-out file: `writing`, `reasoning` (puzzles with drawn names and numbers), `coding`, `stem` explanations and
`humanities`, its lines interleaved kind by kind so that any first part of it covers every kind.

Where the prompts come from:
  - word lists and templates written for this module (questions, sentences to translate, roles, math problems with
    drawn numbers, short structured texts such as order confirmations or flat listings with drawn fields);
  - passages: prose replies of ShareGPT training-split conversations (`trainers.sharegpt`, the package the training
    prompts come from; never its held-out split), to summarize, extract from, or answer from. A RAG prompt asks the
    conversation's own question about its reply, or (one in five) another conversation's question, which the
    passage does not answer.

The output is a question file (one JSON object a line: `question_id` "<kind>:<n>", `category`, `turns`, and
`source`, where a passage came from), the format of `eval/questions/` that `data.distill.source=prompts` reads.
The same seed and ShareGPT file give the same lines. tests/test_seed_prompts.py checks that none of them overlaps
a held-out question file of eval/questions/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from eagle_lite.atomic import write_text_atomic
from eagle_lite.cli import entry_point
from eagle_lite.config import add_flag

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "prompts" / "seed_kinds.jsonl"
KINDS = ("qa", "translation", "summarization", "rag", "math", "extraction", "roleplay")

# -- short factual questions ------------------------------------------------------------------------
COUNTRIES = ["France", "Japan", "Kenya", "Brazil", "Canada", "Egypt", "Norway", "Peru", "Vietnam", "Argentina",
             "Thailand", "Poland", "Morocco", "Chile", "Portugal", "Greece", "Turkey", "Ireland", "Mexico", "Nigeria",
             "Sweden", "Finland", "Indonesia", "Colombia", "Hungary", "Austria", "New Zealand", "South Korea",
             "Iceland", "Ghana", "Cuba", "Denmark", "Belgium", "Switzerland", "Pakistan", "Malaysia", "Ethiopia",
             "the Czech Republic", "Romania", "Ukraine", "the Netherlands", "Spain", "Italy", "Germany", "India",
             "China", "Saudi Arabia", "the Philippines", "Australia", "Scotland"]
CAPITAL = ["What is the capital of {x}?", "What's the capital city of {x}?", "Name the capital of {x}.",
           "Which city is the capital of {x}?"]
BOOKS = ["Pride and Prejudice", "1984", "Moby-Dick", "The Great Gatsby", "War and Peace", "Don Quixote", "Jane Eyre",
         "The Odyssey", "Hamlet", "One Hundred Years of Solitude", "The Catcher in the Rye", "Frankenstein", "Dracula",
         "Crime and Punishment", "The Little Prince", "To Kill a Mockingbird", "Brave New World", "The Hobbit",
         "Les Miserables", "Wuthering Heights", "The Old Man and the Sea", "Anna Karenina", "Great Expectations",
         "The Divine Comedy", "Romeo and Juliet", "Things Fall Apart", "The Count of Monte Cristo", "Madame Bovary",
         "Fahrenheit 451", "Alice's Adventures in Wonderland"]
AUTHOR = ["Who wrote {x}?", "Who is the author of {x}?", "Who wrote the book {x}, and when?"]
CONCEPTS = ["photosynthesis", "inflation", "a black hole", "an algorithm", "gravity", "a haiku", "a mortgage",
            "an ecosystem", "a metaphor", "an interest rate", "a galaxy", "an atom", "evolution", "a sonnet",
            "a volcano", "erosion", "a calorie", "an enzyme", "a hurricane", "the stock market", "a compiler",
            "a firewall", "a protein", "osmosis", "a tariff", "a glacier", "an allergy", "a recession", "a fossil",
            "friction", "a symphony", "an ion", "a password manager", "a prime number", "a thesaurus", "a tsunami",
            "a satellite", "an antonym", "the water cycle", "a carbon footprint", "a credit score", "a spreadsheet",
            "a podcast", "a marathon", "a constellation", "an earthquake", "a chromosome", "a budget deficit",
            "a food chain", "an eclipse"]
DEFINE = ["What is {x}?", "What is {x}? Answer in one or two sentences.", "Briefly, what is {x}?",
          "Can you explain what {x} is in simple words?"]
LANDMARKS = ["the Eiffel Tower", "Machu Picchu", "the Taj Mahal", "the Colosseum", "Angkor Wat", "Petra",
             "Stonehenge", "Mount Kilimanjaro", "the Acropolis", "Chichen Itza", "the Sagrada Familia",
             "Table Mountain", "the Statue of Liberty", "Neuschwanstein Castle", "the Alhambra", "Uluru", "Mount Fuji",
             "the Blue Mosque", "the Leaning Tower of Pisa", "the Christ the Redeemer statue", "the Burj Khalifa",
             "the Parthenon", "the Golden Gate Bridge", "Big Ben", "the Great Pyramid of Giza"]
WHERE = ["In which country is {x}?", "Where is {x} located?", "Which city is {x} in?"]
ELEMENTS = ["gold", "silver", "iron", "sodium", "potassium", "oxygen", "hydrogen", "carbon", "helium", "copper",
            "lead", "mercury", "calcium", "nitrogen", "tin", "zinc", "uranium", "neon", "chlorine", "magnesium"]
SYMBOL = ["What is the chemical symbol for {x}?", "What is the symbol of {x} on the periodic table?"]
ACRONYMS = ["CPU", "NASA", "HTML", "GDP", "UNESCO", "URL", "PDF", "RAM", "USB", "NATO", "ATM", "GPS", "LED",
            "FAQ", "ISBN", "UV", "HIV", "SQL", "UNICEF", "JPEG"]
ACRONYM = ["What does {x} stand for?", "What is the meaning of the abbreviation {x}?"]
FACTS = [
    "How many legs does a spider have?", "How many continents are there?",
    "What is the freezing point of water in Celsius?", "What is the tallest mountain in the world?",
    "What is the longest river in Africa?", "How many days are in a leap year?",
    "What gas do plants take in from the air?", "What is the hardest natural substance?",
    "Which planet is known as the Red Planet?", "How many players does a soccer team have on the field?",
    "What is the smallest prime number?", "Who developed the theory of relativity?", "Who discovered penicillin?",
    "What is the main language spoken in Brazil?", "What currency is used in Japan?", "How many minutes are in a day?",
    "What is the square root of 144?", "Which organ pumps blood around the body?",
    "What is the largest hot desert in the world?", "How many strings does a standard guitar have?",
    "Roughly how fast does light travel?", "Who was the first President of the United States?",
    "What is the largest mammal on Earth?", "How many sides does a hexagon have?",
    "What is the chemical formula for water?", "Which metal is liquid at room temperature?",
    "In what year did World War II end?", "What is the largest country by area?",
    "How long does it take the Earth to orbit the Sun?", "What is the closest star to Earth?",
    "What are the three primary colors of paint?", "How many hours are in a week?",
    "Who composed The Four Seasons?", "Who painted the Mona Lisa?", "Which instrument usually has 88 keys?",
    "What is the longest bone in the human body?", "How many teeth does an adult human usually have?",
    "What is the currency of the United Kingdom?", "Who was Cleopatra?",
    "What is the longest river in South America?", "What is the largest organ of the human body?",
    "How many planets orbit the Sun?", "What is the main ingredient in guacamole?",
    "What language has the most native speakers?", "How many centimeters are in a meter?",
    "Which animal is the fastest on land?", "Who invented the telephone?", "What is the capital of the state of Texas?",
    "How many weeks are in a year?", "What is the name of the galaxy we live in?",
    "Who was the first woman to win a Nobel Prize?", "Which bird is a symbol of peace?",
    "What do bees make from nectar?", "How many sides does a triangle have?",
    "Which country gave the Statue of Liberty to the United States?", "What is the largest island in the world?",
    "What is the boiling point of water in Celsius at sea level?", "Who wrote the play Macbeth?",
    "What is the most common gas in Earth's atmosphere?", "How many zeros are there in one million?",
]
QA_PREFIX = ["", "", "", "Quick question: ", "Short answer, please: ", "I was wondering: "]
QA_FOLLOW_UP = ["Can you tell me a bit more about that?", "Why is that?", "Are you sure? How do you know?",
                "Give me one interesting fact related to that.", "Can you say that in one sentence?"]

# -- translation --------------------------------------------------------------------------------------
ENGLISH = [
    "Where is the nearest train station?", "I would like to book a table for two at eight o'clock.",
    "The weather is beautiful today, so let's eat outside.", "Can you help me carry these boxes upstairs?",
    "My brother works as a nurse at the city hospital.", "We are planning a trip to the mountains next summer.",
    "I forgot my umbrella at the office.", "How much does this jacket cost?",
    "The meeting has been moved to Friday afternoon.", "Please send me the report before noon.",
    "Our cat sleeps on the windowsill every morning.", "I have been learning to play the piano for two years.",
    "Excuse me, is this seat taken?", "The library opens at nine and closes at six.",
    "Could you speak a little more slowly, please?", "She bought fresh bread and cheese at the market.",
    "I am allergic to peanuts.", "The children are playing in the garden.", "What time does the last bus leave?",
    "Thank you very much for your help yesterday.", "I need to buy a birthday present for my father.",
    "The hotel room has a view of the sea.", "It takes about twenty minutes to walk to school.",
    "We watched an old movie last night.", "Do you know a good place to buy shoes?",
    "The soup is too hot to eat right now.", "My phone battery is almost empty.",
    "He is reading a book about ancient Egypt.", "Please turn left at the next traffic light.",
    "I am sorry, but I do not understand.", "The concert starts at half past seven.",
    "Our neighbors have a big black dog.", "I usually drink tea in the morning and coffee in the afternoon.",
    "The doctor said I should rest for a few days.", "Can I pay by credit card?",
    "The museum has a new exhibition about dinosaurs.", "We need more chairs for the guests.",
    "It rained all weekend, so we stayed at home.", "I lost my keys somewhere in the park.",
    "The train was late because of the snow.", "Could you suggest a book for a long flight?",
    "My favorite season is autumn.", "The shop on the corner sells flowers and plants.",
    "Please close the window; it is getting cold.", "I will call you when I arrive at the airport.",
    "They are building a new bridge across the river.", "Is there a pharmacy open on Sundays?",
    "She speaks three languages fluently.", "Let's meet in front of the cinema at six.",
    "The view from the top of the hill is amazing.",
]
LANGUAGES = ["Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese", "Russian",
             "Polish"]
TO_LANGUAGE = ['Translate into {lang}: "{s}"', 'How do you say "{s}" in {lang}?',
               "Can you translate this sentence to {lang}? {s}", "Please translate the following into {lang}.\n\n{s}",
               'What is "{s}" in {lang}?', "Translate to {lang}, please: {s}"]
FOREIGN = [
    ("French", "Je voudrais un café au lait, s'il vous plaît."),
    ("French", "Nous avons visité le château pendant les vacances."),
    ("French", "Le magasin ferme à dix-neuf heures."),
    ("French", "Mon frère habite à Marseille depuis cinq ans."),
    ("French", "Il fait très froid ce matin."),
    ("French", "Est-ce que tu peux m'aider avec mes devoirs ?"),
    ("French", "J'ai oublié mon passeport à l'hôtel."),
    ("Spanish", "¿Dónde está la biblioteca?"),
    ("Spanish", "Mañana vamos a la playa con mis primos."),
    ("Spanish", "Me gusta mucho cocinar los domingos."),
    ("Spanish", "El tren sale a las ocho y media."),
    ("Spanish", "Necesito comprar leche y huevos."),
    ("Spanish", "Mi abuela vive en un pueblo pequeño cerca de Sevilla."),
    ("Spanish", "¿Cuánto cuesta una entrada para el museo?"),
    ("German", "Ich habe heute keine Zeit, aber morgen schon."),
    ("German", "Wo kann ich hier ein Taxi finden?"),
    ("German", "Das Wetter soll am Wochenende besser werden."),
    ("German", "Meine Schwester studiert Medizin in Berlin."),
    ("German", "Wir haben den Zug um fünf Minuten verpasst."),
    ("German", "Kannst du mir bitte das Salz geben?"),
    ("Italian", "Vorrei prenotare una camera per tre notti."),
    ("Italian", "Il negozio è chiuso per ferie."),
    ("Italian", "Abbiamo mangiato una pizza buonissima a Napoli."),
    ("Italian", "A che ora comincia la lezione?"),
    ("Portuguese", "Eu gosto de caminhar na praia ao pôr do sol."),
    ("Portuguese", "O ônibus está atrasado de novo."),
    ("Portuguese", "Você sabe onde fica o correio?"),
]
FROM_LANGUAGE = ['What does this {lang} sentence mean in English? "{s}"', "Translate from {lang} to English: {s}",
                 'Translate into English: "{s}"', "I saw this sentence in {lang}: {s}\nWhat does it mean?"]
TRANSLATION_FOLLOW_UP = ["Now translate it into {lang2}.", "Can you make it sound more formal?",
                         "Explain the grammar of your translation briefly.", "How would I say it more casually?"]

# -- passages (ShareGPT replies) -----------------------------------------------------------------------
SUMMARIZE = [
    "Summarize this text in {n} sentences.\n\n{p}", "Give me a {n}-bullet summary of the text below.\n\n{p}",
    "TL;DR:\n\n{p}", "{p}\n\nSummarize the text above in one short paragraph.",
    "Explain the main idea of this passage to a 12-year-old in a few sentences.\n\n{p}",
    "Write a headline and a two-sentence summary for this text.\n\n{p}",
    "What is the main point of the following text? Answer briefly.\n\n{p}",
    "Condense this into a single sentence:\n\n{p}",
    "Summarize the key points as a short list.\n\n{p}",
]
SUMMARY_FOLLOW_UP = ["Now make it even shorter.", "Rewrite the summary in a more formal tone.",
                     "What is one detail you left out?", "Give it a short title."]
RAG = [
    "Context:\n{p}\n\nUsing only the context above, answer: {q}",
    "Read the passage and answer the question. If the passage does not contain the answer, say so.\n\n"
    "Passage:\n{p}\n\nQuestion: {q}",
    "Here is some information:\n\n{p}\n\nBased on this information: {q}",
    'Document:\n"""\n{p}\n"""\n\nQuestion: {q}\nAnswer from the document only.',
    "{p}\n\nAccording to the text above, {q}",
]
RAG_FOLLOW_UP = ["Which sentence of the passage supports your answer?", "Can you answer that in one sentence?",
                 "Is there anything the passage does not tell us about this?"]
EXTRACT_TEXT = [
    "List all the names of people, places, organizations or products in this text as JSON with the keys "
    "people, places, organizations and products.\n\n{p}",
    "Pull out the main recommendations from this text as a numbered list.\n\n{p}",
    "Make a list of the key terms used in this passage, each with a short definition based on the text.\n\n{p}",
    "Turn this text into a bulleted list of facts, one per line.\n\n{p}",
    "Extract the steps or actions described in this text, in order.\n\n{p}",
]
EXTRACT_NUMBERS = "Extract every number mentioned in the text below and say what it refers to.\n\n{p}"

# -- step-by-step math ---------------------------------------------------------------------------------
NAMES = ["Maya", "Tom", "Aisha", "Lucas", "Mei", "Omar", "Sofia", "Daniel", "Priya", "Jonas", "Elena", "Kofi",
         "Hana", "Mateo", "Grace", "Ivan", "Nadia", "Sam", "Lena", "Ravi"]
ITEMS = ["backpack", "pair of shoes", "lamp", "board game", "winter coat", "bicycle helmet", "coffee maker",
         "desk chair", "phone case", "set of headphones"]
MATH_SUFFIX = [" Show your work.", " Solve it step by step.", " Explain each step.", " Think step by step.", ""]
MATH_FOLLOW_UP = ["Can you check your answer another way?", "Explain the second step in more detail.",
                  "Now make up a similar problem for me to practice."]

# -- extraction from structured texts ----------------------------------------------------------------------
CITIES = ["Leeds", "Porto", "Austin", "Lyon", "Graz", "Osaka", "Denver", "Cork", "Tampere", "Bologna", "Halifax",
          "Adelaide", "Utrecht", "Krakow", "Valencia", "Nairobi"]
SURNAMES = ["Novak", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Kowalski", "Haddad", "Brennan", "Costa",
            "Fischer", "Mendes", "Ibrahim", "Larsen", "Rossi", "Chen"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]

# -- roleplay ------------------------------------------------------------------------------------------------
ROLES = [
    ("a pirate captain", "Tell your new crew where we are sailing and why."),
    ("a librarian in a small-town library",
     "A teenager asks you to recommend a book for a school project about space."),
    ("a customer support agent for an internet provider",
     "I'm calling because my internet has been down since this morning."),
    ("a personal fitness coach", "It's my first session and I haven't exercised in years."),
    ("a detective in 1940s Los Angeles", "A nervous client walks into your office with a missing-person case."),
    ("a wise old wizard", "A young apprentice asks you what the most important lesson of magic is."),
    ("a flight attendant", "Give the welcome announcement before takeoff."),
    ("a chef running a food truck", "A customer asks what today's special is and whether it's spicy."),
    ("a guide at a natural history museum", "Introduce the dinosaur hall to a group of schoolchildren."),
    ("an astronaut on the International Space Station",
     "A student on a video call asks what you eat for breakfast in space."),
    ("a shopkeeper in a fantasy village", "An adventurer asks what supplies to buy before crossing the desert."),
    ("a tech support volunteer at a senior center",
     "I can't figure out how to video-call my grandson on my new tablet."),
    ("a travel agent", "I want a one-week vacation somewhere warm in February on a modest budget."),
    ("a medieval blacksmith", "A farmer asks you to fix a broken plow before the harvest."),
    ("a kindergarten teacher", "Explain to the class why we wash our hands before lunch."),
    ("a sports commentator", "Describe the final minute of a close basketball game."),
    ("a real estate agent", "Show me around a small two-bedroom apartment."),
    ("a bookstore owner", "A customer says they loved a fantasy series and wants something similar."),
    ("a zookeeper", "A visitor asks you about the penguins you take care of."),
    ("a taxi driver in New York", "I'm a tourist with one day in the city. What should I see?"),
    ("an old sailor in a harbor tavern", "Tell the story of the strangest thing you ever saw at sea."),
    ("a gardener at a botanical garden", "A visitor asks how to keep their houseplants alive."),
    ("a news anchor", "Report on a small town's annual pumpkin festival."),
    ("a hotel receptionist", "A guest arrives late at night and their reservation is missing."),
    ("a math tutor", "A student says fractions make no sense to them."),
    ("a spaceship's onboard computer", "The crew asks for a status report after a meteor shower."),
    ("a grumpy but kind mountain hermit", "A lost hiker knocks on your door at dusk."),
    ("a car mechanic", "My car makes a squeaking noise when I brake."),
    ("a nutritionist", "I want to eat healthier but I don't have much time to cook."),
    ("a time traveler from the year 2300", "Describe what a normal school day is like in your time."),
    ("a theater director", "Give a pep talk to the cast before opening night."),
    ("a farmer at a farmers' market", "A shopper asks which vegetables are in season."),
    ("a Spanish teacher", "Start the first lesson for a class of complete beginners."),
    ("a dragon guarding a treasure", "A clever knight tries to talk you into sharing your gold."),
    ("a shopkeeper in a video game", "The player walks into your shop for the first time."),
    ("a career counselor", "I'm 30 and thinking about switching from accounting to graphic design."),
    ("a tailor", "A customer needs a suit altered for a wedding next week."),
    ("a radio DJ on a late-night show", "Introduce the next song and read out a listener's dedication."),
    ("a ship's navigator in the age of exploration", "The captain asks how far we are from land."),
    ("an art teacher", "Explain to beginners how to draw a simple landscape."),
]
ROLE_OPENING = ["You are {role}. {situation} Stay in character.", "Pretend to be {role}. {situation}",
                "Let's role-play. You're {role}. {situation}", "Act as {role}. {situation}"]
ROLE_GENERIC = ["Introduce yourself and describe what a typical day looks like for you.",
                "Tell me about the hardest day you ever had in your work.",
                "What advice would you give to someone who wants to do what you do?",
                "Describe your favorite part of the job.",
                "I ask you something you don't know the answer to. How do you respond?"]
ROLE_FOLLOW_UP = ["Thank you! One more question: what do you do when things go wrong?",
                  "Can you tell me more about that?", "What should I do next?",
                  "That's great. Any last advice before I go?"]


@dataclass(frozen=True)
class Passage:
    source: str           # "sharegpt:<conversation id>"
    text: str             # a prose reply
    question: str | None  # the user turn it answers, when that is one short question


def _hash_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_OPENERS = ("i ", "i'm", "i'd", "i've", "as an", "sure", "certainly", "yes", "no,", "no.", "okay", "ok", "great",
            "thank", "thanks", "hi", "hello", "dear", "here", "in that case", "based on", "of course", "absolutely",
            "you ", "you're", "this ", "that ", "these ", "it ", "my ", "apolog", "sorry", "understood", "got it")
_CONTEXT_WORDS = ("you mentioned", "earlier", "above", "previous", "as requested", "your request", "your question",
                  "the following", "below")


def _is_prose(text: str) -> bool:
    """A reply worth summarizing: 60-260 words of plain English paragraphs that stand on their own: no code, lists,
    tables, links or letters, and no opening that answers an earlier turn."""
    words = text.split()
    if not 60 <= len(words) <= 260 or not text.isascii() or any(c in text for c in "`|#*<>{}[]=\\_"):
        return False
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) > 5 or any(re.match(r"\s*(\d+[.)]|-|\u2022)\s", line) for line in lines) or "http" in text:
        return False
    low = text.lower()
    if text.count(". ") < 3 or low.startswith(_OPENERS) or any(w in low for w in _CONTEXT_WORDS):
        return False
    return True


def sharegpt_passages(path: str | Path | None = None) -> list[Passage]:
    """Prose replies of ShareGPT training-split conversations, in a fixed order spread over the file (by a hash of
    the conversation id), with the user's question where it is one short question."""
    import warnings

    from .sharegpt import TruncatedDataWarning, load_conversations

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedDataWarning)
        conversations = load_conversations("train", path=path)
    passages = []
    for conversation in conversations:
        turns = conversation.turns
        for k, turn in enumerate(turns):
            if turn.role != "assistant" or not _is_prose(turn.content.strip()):
                continue
            question = turns[k - 1].content.strip() if k and turns[k - 1].role == "user" else ""
            short = 4 <= len(question.split()) <= 30 and question.endswith("?") and question.isascii() \
                and question.count("?") == 1 and "\n" not in question
            passages.append(Passage(f"sharegpt:{conversation.id}", turn.content.strip(), question if short else None))
            break   # one passage a conversation
    passages.sort(key=lambda p: _hash_key(p.source))
    return passages


def _first_sentence(text: str) -> str | None:
    """The passage's first sentence when it is a plain one of 8-25 words, else None."""
    match = re.match(r"([A-Z][^.!?:\n]*[.])\s", text)
    if match is None:
        return None
    sentence = match.group(1)
    return sentence if 8 <= len(sentence.split()) <= 25 else None


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.items: list[dict] = []
        self.seen: set[str] = set()

    def add(self, kind: str, turns: list[str], source: str | None = None) -> None:
        key = "\n".join(turns)
        if key in self.seen:
            return
        self.seen.add(key)
        n = sum(1 for item in self.items if item["category"] == kind)
        item = {"question_id": f"{kind}:{n:04d}", "category": kind, "turns": turns}
        if source:
            item["source"] = source
        self.items.append(item)

    def maybe_follow_up(self, first: str, follow_ups: list[str], share: float = 0.2) -> list[str]:
        return [first, self.rng.choice(follow_ups)] if self.rng.random() < share else [first]


def _qa(b: _Builder) -> None:
    rng = b.rng
    lists = [(COUNTRIES, CAPITAL), (BOOKS, AUTHOR), (CONCEPTS, DEFINE), (LANDMARKS, WHERE), (ELEMENTS, SYMBOL),
             (ACRONYMS, ACRONYM)]
    questions = [rng.choice(templates).format(x=x) for values, templates in lists for x in values] + FACTS
    for question in questions:
        prefix = "" if question.startswith("Name") else rng.choice(QA_PREFIX)
        # every question starts with a common word (What, Who, How, ...): lower-cased after a prefix
        text = prefix + question[0].lower() + question[1:] if prefix else question
        b.add("qa", b.maybe_follow_up(text, QA_FOLLOW_UP))


def _translation(b: _Builder, passages: list[Passage]) -> None:
    rng = b.rng
    for sentence in ENGLISH:
        for lang in rng.sample(LANGUAGES, 3):
            first = rng.choice(TO_LANGUAGE).format(lang=lang, s=sentence)
            follow = rng.choice(TRANSLATION_FOLLOW_UP).format(lang2=rng.choice([x for x in LANGUAGES if x != lang]))
            b.add("translation", [first, follow] if rng.random() < 0.2 else [first])
    for lang, sentence in FOREIGN:
        for template in rng.sample(FROM_LANGUAGE, 2):
            b.add("translation", [template.format(lang=lang, s=sentence)])
    taken = 0
    for passage in passages:
        sentence = _first_sentence(passage.text)
        if sentence is None:
            continue
        b.add("translation", [rng.choice(TO_LANGUAGE).format(lang=rng.choice(LANGUAGES), s=sentence)], passage.source)
        taken += 1
        if taken == 100:
            break


def _passage_kinds(b: _Builder, passages: list[Passage], per_kind: int) -> None:
    """Summaries, RAG answers and extraction over distinct passages (those used for translation may repeat)."""
    rng = b.rng
    with_question = [p for p in passages if p.question]
    rag, used = with_question[:per_kind], {p.source for p in with_question[:per_kind]}
    other = [p for p in passages if p.source not in used]
    summary, extraction = other[:per_kind], other[per_kind:2 * per_kind]
    others_questions = [p.question for p in with_question[per_kind:]]
    for k, passage in enumerate(rag):
        if k % 5 == 4 and others_questions:   # a question the passage does not answer
            question, template = others_questions[k % len(others_questions)], RAG[1]
        else:
            question, template = passage.question, rng.choice(RAG)
        first = template.format(p=passage.text,
                                q=question if template != RAG[4] else question[0].lower() + question[1:])
        b.add("rag", b.maybe_follow_up(first, RAG_FOLLOW_UP), passage.source)
    for passage in summary:
        first = rng.choice(SUMMARIZE).format(p=passage.text, n=rng.choice(["two", "three"]))
        b.add("summarization", b.maybe_follow_up(first, SUMMARY_FOLLOW_UP), passage.source)
    for passage in extraction:
        template = (EXTRACT_NUMBERS if re.search(r"\d", passage.text) and rng.random() < 0.5
                    else rng.choice(EXTRACT_TEXT))
        b.add("extraction", [template.format(p=passage.text)], passage.source)


def _date(rng: random.Random) -> str:
    return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"


def _person(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"


def _structured_texts(rng: random.Random) -> list[tuple[str, str]]:
    """(text, instruction) pairs of short everyday documents with drawn fields."""
    out = []
    for _ in range(20):
        name, qty, price, days = _person(rng), rng.randint(1, 5), rng.randint(8, 120), rng.randint(2, 7)
        item, city, order = rng.choice(ITEMS), rng.choice(CITIES), rng.randint(10000, 99999)
        out.append((f"Hi {name.split()[0]}, thanks for your order #{order} placed on {_date(rng)}. You ordered "
                    f"{qty} x {item} at ${price}.00 each. Your order will be shipped to our pickup point in {city} "
                    f"within {days} business days, and you will get a tracking link by email.",
                    "Extract the customer's first name, order number, order date, item, quantity and total price "
                    "as JSON."))
    for _ in range(20):
        name, doctor, city = _person(rng), rng.choice(SURNAMES), rng.choice(CITIES)
        hour, minutes, early = rng.randint(8, 17), rng.choice(["00", "15", "30", "45"]), rng.choice([10, 15, 20])
        kind = rng.choice(["dental", "eye", "physiotherapy", "check-up", "dermatology"])
        out.append((f"This is a reminder that {name} has a {kind} appointment with Dr. {doctor} on "
                    f"{rng.choice(DAYS)}, {_date(rng)} at {hour}:{minutes} at our {city} clinic. Please arrive "
                    f"{early} minutes early and bring your insurance card. To reschedule, call us at least 24 hours "
                    f"before the appointment.",
                    "What are the patient's name, the doctor, the date, the time and the place? Answer as a list."))
    for _ in range(20):
        org = rng.choice(["The Riverside Choir", "Green Streets Club", "The City Chess Society", "Northgate School",
                          "The Harbor Film Club", "Maple Street Bakery"])
        event = rng.choice(["a spring concert", "a charity fun run", "an open day", "a film night", "a book fair",
                            "a community picnic"])
        start, adult, child = rng.randint(10, 19), rng.randint(5, 30), rng.randint(0, 10)
        out.append((f"{org} invites you to {event} on {_date(rng)} from {start}:00 to {start + rng.randint(2, 4)}:00 "
                    f"at the {rng.choice(['town hall', 'community center', 'public library', 'old mill'])} in "
                    f"{rng.choice(CITIES)}. Tickets cost ${adult} for adults and ${child} for children under 12. "
                    f"All proceeds go to "
                    f"{rng.choice(['the local food bank', 'a new playground', 'the animal shelter'])}.",
                    "Put the event name, organizer, date, time, venue and ticket prices into a table."))
    for _ in range(20):
        name, company = _person(rng), rng.choice(["Brightline Media", "Northwind Logistics", "Aster Health",
                                                  "Bluepeak Software", "Cobalt Design Studio"])
        title = rng.choice(["Project Manager", "Sales Director", "Office Coordinator", "Lead Engineer", "Accountant"])
        phone = f"+1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
        email = f"{name.split()[0].lower()}.{name.split()[1].lower()}@{company.split()[0].lower()}.example"
        out.append((f"Thanks for meeting with us on {rng.choice(DAYS)}. I've attached the proposal we discussed and "
                    f"look forward to your feedback by {_date(rng)}.\n\nBest regards,\n{name}\n{title}, {company}\n"
                    f"Phone: {phone}\nEmail: {email}",
                    "Extract the sender's contact details (name, job title, company, phone, email) as JSON."))
    for _ in range(20):
        beds, size, rent = rng.randint(1, 4), rng.randint(35, 140), rng.randint(6, 30) * 100
        feature = rng.choice(["a small balcony", "a shared garden", "new kitchen appliances", "a parking space",
                              "large windows facing south"])
        out.append((f"{beds}-bedroom apartment for rent in {rng.choice(CITIES)}. {size} square meters on the "
                    f"{rng.choice(['first', 'second', 'third', 'fourth'])} floor, with {feature}. Rent is ${rent} per "
                    f"month plus ${rng.randint(5, 25) * 10} for utilities; available from {_date(rng)}. "
                    f"{rng.choice(['Pets are welcome.', 'No pets, please.', 'Small pets are allowed.'])}",
                    "Extract the number of bedrooms, size, rent, utilities, availability date and pet policy as JSON."))
    return out


def _extraction(b: _Builder) -> None:
    for text, instruction in _structured_texts(b.rng):
        first = f"{instruction}\n\n{text}" if b.rng.random() < 0.7 else f"{text}\n\n{instruction}"
        b.add("extraction", [first])


def _math_problems(rng: random.Random) -> list[str]:
    """One problem from each of 20 templates, numbers drawn."""
    name, other = rng.sample(NAMES, 2)
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    q, d = rng.randint(6, 60), rng.randint(3, 19)
    x, k = rng.randint(-9, 15), rng.randint(2, 9)
    c0 = rng.randint(1, 30)
    price, off = rng.randint(20, 200), rng.choice([10, 15, 20, 25, 30, 40])
    v, t = rng.randint(40, 120), rng.choice([1.5, 2, 2.5, 3, 4])
    nums = [rng.randint(10, 99) for _ in range(rng.randint(4, 6))]
    fb, fd = rng.randint(2, 9), rng.randint(2, 9)
    fa, fc = rng.randint(1, fb - 1), rng.randint(1, fd - 1)      # proper fractions
    w, h = rng.randint(3, 25), rng.randint(3, 25)
    workers, days = rng.randint(2, 8), rng.randint(3, 12)
    total, r1, r2 = rng.randint(5, 40) * 10, rng.randint(1, 5), rng.randint(1, 5)
    rate, principal, years = rng.choice([2, 3, 4, 5, 6]), rng.randint(5, 50) * 100, rng.randint(2, 6)
    hour, minute, length = rng.randint(12, 21), rng.choice([0, 10, 15, 20, 30, 45]), rng.randint(85, 175)
    age, times, later = rng.randint(6, 14), rng.randint(3, 5), rng.randint(15, 30)
    box, eggs = rng.choice([6, 10, 12]), rng.randint(25, 150)
    start, step, ratio = rng.randint(1, 20), rng.randint(2, 9), rng.choice([2, 3])
    slices, people, each = rng.choice([8, 10, 12]), rng.randint(2, 3), rng.randint(1, 2)
    fahrenheit, km = rng.randint(20, 100), rng.randint(5, 50)
    arithmetic = ", ".join(str(start + step * i) for i in range(4))
    geometric = ", ".join(str(start * ratio ** i) for i in range(4))
    return [
        f"What is {a} x {b}?",
        f"What is {q * d} divided by {d}?",
        f"What is {off}% of {price * 10}?",
        f"A {rng.choice(ITEMS)} costs ${price}. It is on sale for {off}% off. What is the sale price?",
        f"Solve for x: {k}x + {c0} = {k * x + c0}.",
        f"A train travels at {v} km/h for {t} hours. How far does it go?",
        f"{name} has {a} marbles. She gives {d} to {other} and then buys {c0} more. "
        f"How many marbles does she have now?",
        f"What is the average of {', '.join(map(str, nums[:-1]))} and {nums[-1]}?",
        f"What is {fa}/{fb} + {fc}/{fd}? Give the answer as a simplified fraction.",
        f"A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?",
        f"A triangle has a base of {w} m and a height of {h} m. What is its area?",
        f"If {workers} workers can paint a fence in {days} days, how many days would {workers * 2} workers need, "
        f"working at the same rate?",
        f"{name} and {other} share ${total} in the ratio {r1}:{r2}. How much does each of them get?",
        f"A savings account pays {rate}% simple interest per year. How much interest does ${principal} earn in "
        f"{years} years?",
        f"A movie starts at {hour}:{minute:02d} and lasts {length} minutes. What time does it end?",
        f"{name} is {age} years old, and her aunt is {times} times as old. How old will her aunt be when {name} is "
        f"{later}?",
        f"A carton holds {box} eggs. How many cartons are needed for {eggs} eggs?",
        f"What are the next two numbers in the sequence "
        f"{arithmetic if rng.random() < 0.5 else geometric}?",
        f"A pizza is cut into {slices} equal slices. If {people} people each eat {each} slices, what fraction of the "
        f"pizza is left?",
        f"Convert {fahrenheit} degrees Fahrenheit to Celsius." if rng.random() < 0.5 else f"How many miles is {km} km?",
    ]


def _math(b: _Builder, rounds: int) -> None:
    for _ in range(rounds):
        for problem in _math_problems(b.rng):
            b.add("math", b.maybe_follow_up(problem + b.rng.choice(MATH_SUFFIX), MATH_FOLLOW_UP))


def _roleplay(b: _Builder) -> None:
    rng = b.rng
    for role, situation in ROLES:
        for text in [situation, *rng.sample(ROLE_GENERIC, 3)]:
            first = rng.choice(ROLE_OPENING).format(role=role, situation=text)
            b.add("roleplay", b.maybe_follow_up(first, ROLE_FOLLOW_UP, share=0.35))


def build(seed: int = 0, sharegpt_path: str | Path | None = None, passages_per_kind: int = 240,
          math_rounds: int = 16) -> list[dict]:
    """Every seed prompt, kind by kind (see the module doc)."""
    b = _Builder(seed)
    passages = sharegpt_passages(sharegpt_path)
    _qa(b)
    _translation(b, passages[3 * passages_per_kind:])
    _passage_kinds(b, passages, passages_per_kind)
    _extraction(b)
    _math(b, math_rounds)
    _roleplay(b)
    return b.items


# == the second set: kinds of data/prompts/seed_kinds2.jsonl (writing, reasoning, coding, stem, humanities) ==========
KINDS2 = ("writing", "reasoning", "coding", "stem", "humanities")
DEFAULT_OUT2 = DEFAULT_OUT.with_name("seed_kinds2.jsonl")

# -- writing -------------------------------------------------------------------------------------------------
WRITING_TASKS = [
    ("an email to {who} asking to move our {thing} to next week", ["my manager", "a client", "my professor",
                                                                   "the team"], ["meeting", "call", "review"]),
    ("a thank-you note to {who} for the {thing}", ["my neighbor", "a colleague", "my aunt", "our volunteers"],
     ["birthday gift", "help with the move", "dinner invitation", "kind words"]),
    ("a short poem about {thing}, for {who}", ["a friend's wedding card", "a school newsletter", "my journal",
                                               "a greeting card"],
     ["autumn leaves", "the sea at dawn", "a city at night", "an old oak tree", "the first day of spring"]),
    ("a product description for {thing}, aimed at {who}", ["busy parents", "students", "hikers", "home cooks",
                                                           "small business owners"],
     ["a foldable travel kettle", "a solar phone charger", "a wool winter hat", "a set of glass food containers",
      "a standing desk converter", "a waterproof notebook"]),
    ("the opening paragraph of a {thing} story for {who}", ["young readers", "adults", "a writing class"],
     ["science fiction", "fantasy", "detective", "ghost", "adventure", "comedy"]),
    ("a short speech for {who} at {thing}", ["a retiring coworker", "my best friend", "our team captain",
                                             "my sister"],
     ["a farewell party", "a wedding reception", "an awards dinner", "a graduation lunch"]),
    ("a social media post announcing {thing}, written for {who}", ["our customers", "our followers",
                                                                  "local residents"],
     ["the opening of our new cafe", "a weekend sale at our bike shop", "our library's summer reading program",
      "a charity bake sale", "new opening hours at our gym"]),
    ("a polite complaint letter to {who} about {thing}", ["an airline", "a hotel", "an online store",
                                                          "the city council"],
     ["a late delivery", "a noisy room", "a damaged package", "a broken streetlight", "a cancelled booking"]),
    ("a restaurant review of {thing}, written for {who}", ["a food blog", "a local newspaper", "a travel site"],
     ["a small Italian trattoria", "a vegan burger place", "a family-run sushi bar", "a busy breakfast diner"]),
    ("an invitation to {thing} for {who}", ["my classmates", "the neighbors", "my coworkers", "family members"],
     ["a garden party", "a housewarming", "a board game night", "a surprise birthday dinner"]),
    ("a motivational message for {who} before {thing}", ["a nervous student", "my running club",
                                                         "a new employee"],
     ["a big exam", "a marathon", "the first day at work", "a job interview"]),
    ("a short bio of about {thing} for {who}", ["a conference program", "a company website", "a podcast page"],
     ["80 words", "100 words", "three sentences"]),
]
WRITING_OPENERS = ["Write {t}.", "Please write {t}.", "Can you write {t}?", "Help me write {t}.", "Draft {t}."]
WRITING_SUFFIX = ["", "", " Keep it short.", " Make it warm and friendly.", " Use a formal tone.",
                  " Keep it under 150 words.", " Add a little humor."]
WRITING_FOLLOW_UP = ["Make it shorter.", "Now make it more formal.", "Can you make it funnier?",
                     "Give me a different version with a stronger ending.", "Add a catchy title."]

# -- reasoning -------------------------------------------------------------------------------------------------
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
REASONING_SUFFIX = [" Explain your reasoning.", " Think it through step by step.", " Show how you got the answer.",
                    ""]
REASONING_FOLLOW_UP = ["How can you be sure there is no other answer?", "Explain it again more simply.",
                       "Now give me a harder puzzle of the same kind.", "What if one of the facts were different?"]
SYLLOGISMS = [
    ("All cats are mammals", "Some mammals are black", "some cats are black"),
    ("All squares are rectangles", "This shape is a rectangle", "this shape is a square"),
    ("No fish can walk", "A salmon is a fish", "a salmon cannot walk"),
    ("If it rains, the street gets wet", "The street is wet", "it rained"),
    ("If it rains, the street gets wet", "It did not rain", "the street is not wet"),
    ("If I study, I pass", "I did not pass", "I did not study"),
    ("All doctors went to university", "Lena went to university", "Lena is a doctor"),
    ("Every student in the class passed", "Omar is in the class", "Omar passed"),
    ("Some fruits are sweet", "Lemons are fruits", "lemons are sweet"),
    ("All metals conduct electricity", "Copper is a metal", "copper conducts electricity"),
]


def _reasoning_puzzles(rng: random.Random) -> list[str]:
    """One puzzle from each of 12 templates, names and numbers drawn."""
    a, b, c, d = rng.sample(NAMES, 4)
    day, days = rng.choice(WEEKDAYS), rng.randint(9, 40)
    leave_h, leave_m, walk, extra = rng.randint(6, 9), rng.choice([5, 15, 20, 35, 50]), rng.randint(10, 40), \
        rng.randint(5, 15)
    small, big, want = rng.choice([(3, 5, 4), (3, 7, 5), (5, 8, 2), (2, 7, 3), (4, 7, 5)])
    people = rng.randint(4, 12)
    p1, p2 = rng.choice([(4, 7), (5, 8), (3, 11), (6, 9), (5, 7)])
    total = rng.randint(20, 45)
    premise1, premise2, conclusion = rng.choice(SYLLOGISMS)
    age_a, gap = rng.randint(8, 30), rng.randint(2, 9)
    socks, colors = rng.randint(6, 20), rng.randint(2, 4)
    coins = rng.choice([8, 9, 12])
    fruits = rng.sample(["apple", "banana", "cherry", "grape", "pear"], 3)
    vegetable = rng.choice(["carrot", "potato", "onion", "spinach"])
    return [
        f"Today is {day}. What day of the week will it be in {days} days?",
        f"My bus leaves at {leave_h}:{leave_m:02d}. It takes me {walk} minutes to walk to the stop and I want "
        f"{extra} spare minutes. When should I leave?",
        f"{a} is older than {b}. {c} is younger than {b} but older than {d}. Who is the youngest of the four?",
        f"I have a {small}-liter bucket and a {big}-liter bucket and unlimited water. How do I get exactly "
        f"{want} liters?",
        f"If {people} people each shake hands with everyone else exactly once, how many handshakes are there?",
        f"Stamps come in values of {p1} and {p2} cents. Can I pay exactly {total} cents using only these stamps?",
        f"Is this reasoning correct? '{premise1}. {premise2}. So {conclusion}.'",
        f"{a} is {age_a} years old and {gap} years older than {b}. How old was {b} when {a} was twice {b}'s age, "
        f"if ever?",
        f"A drawer holds {socks} black socks and {socks} white socks{'' if colors == 2 else ' and some blue ones'}. "
        f"In the dark, how many socks must I take to be sure of a matching pair?",
        f"I have {coins} coins that look the same, but one is lighter. With a balance scale, what is the smallest "
        f"number of weighings that always finds it?",
        f"{a}, {b} and {c} sit in a row. {a} is not on the left end, and {b} sits to the right of {c}. "
        f"What are the possible seating orders?",
        f"Which one does not belong, and why: {', '.join(fruits)} or {vegetable}?",
    ]


# -- coding --------------------------------------------------------------------------------------------------
CODE_TASKS = [
    "reverses the words in a sentence", "returns the second largest number in a list",
    "checks whether a number is prime", "removes duplicate items from a list while keeping their order",
    "counts the vowels in a string", "converts a temperature from Celsius to Fahrenheit",
    "returns the factorial of n", "merges two sorted lists into one sorted list",
    "finds the longest word in a sentence", "checks whether two strings are anagrams",
    "returns the n-th Fibonacci number", "flattens a nested list", "computes the average of a list of numbers",
    "capitalizes the first letter of every word", "returns the most common element of a list",
    "validates that a string looks like an email address", "sums the digits of an integer",
    "splits a list into chunks of size n", "converts a Roman numeral to an integer",
    "checks whether a year is a leap year", "rotates a list by k positions",
    "finds all pairs of numbers in a list that add up to a target", "converts a string to snake_case",
    "returns the intersection of two lists", "computes the greatest common divisor of two numbers",
]
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Java", "Go", "C", "TypeScript", "Rust", "C#"]
CODE_TEMPLATES = ["Write a {lang} function that {task}.", "In {lang}, how do I write a function that {task}?",
                  "Write {lang} code that {task}, with a short explanation.",
                  "Implement a {lang} function that {task}. Include an example call."]
CODE_CONCEPTS = [
    ("a list comprehension", "Python"), ("a closure", "JavaScript"), ("recursion", "programming"),
    ("a hash map", "programming"), ("Big O notation", "computer science"), ("a race condition", "programming"),
    ("an interface", "Java"), ("a pointer", "C"), ("a promise", "JavaScript"), ("a generator", "Python"),
    ("a decorator", "Python"), ("garbage collection", "programming"), ("a REST API", "web development"),
    ("a foreign key", "SQL"), ("a merge conflict", "git"), ("unit testing", "software development"),
    ("a virtual environment", "Python"), ("an index", "databases"), ("a binary search", "algorithms"),
    ("a stack overflow", "programming"), ("async and await", "JavaScript"), ("a lambda function", "Python"),
    ("a JOIN", "SQL"), ("a Docker container", "software deployment"), ("environment variables", "Bash"),
]
CONCEPT_TEMPLATES = ["What is {c} in {area}? Give a short example.", "Explain {c} in {area} to a beginner.",
                     "Can you explain what {c} means in {area}, with a small code example?"]
SQL_TABLES = [("employees(id, name, department, salary)", ["the average salary per department",
                                                           "the three highest-paid employees",
                                                           "departments with more than five employees"]),
              ("products(id, name, category, price, stock)", ["products that are out of stock",
                                                              "the cheapest product in each category",
                                                              "the total stock value per category"]),
              ("students(id, name, grade) and enrollments(student_id, course, score)",
               ["each student's average score", "students enrolled in no course",
                "the top student in every course"])]
BUGGY = [
    ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
    ("Python", "numbers = [1, 2, 3]\nfor i in range(len(numbers) + 1):\n    print(numbers[i])"),
    ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}"),
    ("Python", "total = 0\nfor n in ['1', '2', '3']:\n    total += n\nprint(total)"),
    ("JavaScript", "if (value == null || value = '') {\n  return false;\n}"),
    ("Python", "def average(xs):\n    return sum(xs) / len(xs)\n\nprint(average([]))"),
    ("C", "int main() {\n    int a[5];\n    for (int i = 0; i <= 5; i++) a[i] = i;\n    return 0;\n}"),
    ("Python", "text = 'hello'\ntext[0] = 'H'\nprint(text)"),
]
BUG_TEMPLATES = ["What is wrong with this {lang} code, and how do I fix it?\n\n{code}",
                 "This {lang} code does not work as expected. Why?\n\n{code}",
                 "Find the bug:\n\n{code}"]
CODING_FOLLOW_UP = ["Can you add comments to the code?", "Now write two tests for it.",
                    "What is the time complexity?", "Can you make it shorter?", "How would it handle empty input?"]

# -- science, technology, engineering, maths (explanations) --------------------------------------------------
STEM_TOPICS = [
    "why the sky is blue", "how a refrigerator keeps food cold", "how batteries store energy",
    "why we have seasons", "how airplanes stay in the air", "what DNA does in a cell", "how a rainbow forms",
    "why metal feels colder than wood at the same temperature", "how the heart pumps blood",
    "what causes earthquakes", "how a microwave oven heats food", "why leaves change color in autumn",
    "how sound travels", "what an electric current is", "how the internet sends data between computers",
    "why salt melts ice on roads", "how lightning forms", "how the immune system fights infections",
    "what a neuron does", "how GPS works out your position", "why the Moon causes tides",
    "how a nuclear power plant makes electricity", "how plants take up water", "what makes a magnet work",
    "why bread rises", "how a camera lens focuses light", "what entropy means", "how antibiotics work",
    "why hot air rises", "how wind turbines generate power", "what pH measures", "how a transistor works",
    "why the ocean is salty", "how a touchscreen detects a finger", "what a light-year is",
    "how an electric motor turns", "why some materials conduct electricity", "how stars produce light",
    "what causes a fever", "how bridges carry heavy loads", "how the lungs exchange oxygen",
    "why boats float", "what a catalyst does in a reaction", "how a thermometer measures temperature",
]
STEM_TEMPLATES = ["Explain {t}.", "Can you explain {t} in simple terms?", "Explain {t} to a high school student.",
                  "In about 100 words, explain {t}.", "I've always wondered {t}. Can you explain?",
                  "Briefly explain {t}, with one everyday example."]
STEM_COMPARE = [("mass", "weight"), ("a conductor", "an insulator"), ("weather", "climate"),
                ("an element", "a compound"), ("mitosis", "meiosis"), ("AC", "DC electricity"),
                ("a comet", "an asteroid"), ("kinetic", "potential energy"), ("an acid", "a base"),
                ("RAM", "storage"), ("heat", "temperature"), ("a genotype", "a phenotype"),
                ("nuclear fission", "fusion"), ("a series", "a parallel circuit")]
STEM_FOLLOW_UP = ["Can you give a real-world example?", "What is a common misconception about this?",
                  "Explain it again for a ten-year-old.", "How do scientists measure it?"]

# -- humanities ------------------------------------------------------------------------------------------------
HISTORY = ["the fall of the Roman Empire", "the Industrial Revolution", "the Renaissance", "the Cold War",
           "the American Civil War", "the Meiji Restoration", "the Protestant Reformation", "the Black Death",
           "the building of the Great Wall of China", "the fall of the Berlin Wall", "the Mongol Empire",
           "the Age of Exploration", "the abolition of slavery in Britain", "the Russian Revolution",
           "the civil rights movement in the United States", "the independence of India", "the Ottoman Empire",
           "the Aztec Empire", "the signing of the Magna Carta", "the Scientific Revolution"]
HISTORY_TEMPLATES = ["What were the main causes of {x}?", "Give a short overview of {x}.",
                     "Why is {x} considered important today?", "What were the main consequences of {x}?",
                     "Summarize {x} for a history class in a few paragraphs."]
THINKERS = ["Confucius", "Socrates", "Immanuel Kant", "Simone de Beauvoir", "John Locke", "Friedrich Nietzsche",
            "Hannah Arendt", "Adam Smith", "Karl Marx", "Rene Descartes", "Laozi", "Mary Wollstonecraft",
            "Jean-Jacques Rousseau", "David Hume", "Thomas Hobbes"]
THINKER_TEMPLATES = ["Who was {x}, and what are they known for?", "What are the main ideas of {x}?",
                     "Explain one key idea of {x} in simple terms.", "How did {x} influence later thinkers?"]
ARTS = ["Impressionism", "the Baroque period in music", "Cubism", "Romanticism in literature", "Gothic architecture",
        "the Harlem Renaissance", "Surrealism", "Greek tragedy", "haiku poetry", "the epic of Gilgamesh",
        "Shakespeare's sonnets", "Renaissance painting", "jazz in the 1920s", "Japanese ukiyo-e prints"]
ARTS_TEMPLATES = ["What is {x}, and what are its main features?", "Describe {x} and name two famous examples.",
                  "Why does {x} matter in the history of art and culture?"]
IDEAS = [("utilitarianism", "ethics"), ("the social contract", "political philosophy"),
         ("supply and demand", "economics"), ("cultural relativism", "anthropology"),
         ("the separation of powers", "government"), ("existentialism", "philosophy"),
         ("nationalism", "history"), ("opportunity cost", "economics"), ("free will", "philosophy"),
         ("federalism", "government"), ("globalization", "sociology"), ("the placebo effect", "psychology")]
IDEA_TEMPLATES = ["What is {x} in {area}? Give an example from everyday life.",
                  "Explain {x} ({area}) in a short paragraph.", "What are the main criticisms of {x}?"]
HUMANITIES_FOLLOW_UP = ["Can you give a concrete example?", "What is a common misunderstanding about this?",
                        "Recommend one book to read about it.", "How does this still matter today?"]


def _writing(b: _Builder) -> None:
    rng = b.rng
    for task, whos, things in WRITING_TASKS:
        combos = [(w, t) for w in whos for t in things]
        for who, thing in rng.sample(combos, min(len(combos), 11)):
            first = rng.choice(WRITING_OPENERS).format(t=task.format(who=who, thing=thing)) + rng.choice(WRITING_SUFFIX)
            b.add("writing", b.maybe_follow_up(first, WRITING_FOLLOW_UP, share=0.25))


def _reasoning(b: _Builder, rounds: int) -> None:
    for _ in range(rounds):
        for puzzle in _reasoning_puzzles(b.rng):
            b.add("reasoning", b.maybe_follow_up(puzzle + b.rng.choice(REASONING_SUFFIX), REASONING_FOLLOW_UP))


def _coding(b: _Builder) -> None:
    rng = b.rng
    for task in CODE_TASKS:
        for lang in rng.sample(CODE_LANGUAGES, 3):
            b.add("coding", b.maybe_follow_up(rng.choice(CODE_TEMPLATES).format(lang=lang, task=task),
                                              CODING_FOLLOW_UP))
    for concept, area in CODE_CONCEPTS:
        b.add("coding", b.maybe_follow_up(rng.choice(CONCEPT_TEMPLATES).format(c=concept, area=area),
                                          CODING_FOLLOW_UP[2:]))
    for table, asks in SQL_TABLES:
        for ask in asks:
            b.add("coding", [f"Given the table {table}, write an SQL query that returns {ask}."])
    for lang, code in BUGGY:
        for template in rng.sample(BUG_TEMPLATES, 2):
            b.add("coding", [template.format(lang=lang, code=code)])


def _stem(b: _Builder) -> None:
    rng = b.rng
    for topic in STEM_TOPICS:
        for template in rng.sample(STEM_TEMPLATES, 2):
            b.add("stem", b.maybe_follow_up(template.format(t=topic), STEM_FOLLOW_UP))
    for x, y in STEM_COMPARE:
        first = rng.choice(["What is the difference between {x} and {y}?", "Compare {x} and {y}.",
                            "How do {x} and {y} differ? Give an example of each."]).format(x=x, y=y)
        b.add("stem", b.maybe_follow_up(first, STEM_FOLLOW_UP))


def _humanities(b: _Builder) -> None:
    rng = b.rng
    for values, templates, k in [(HISTORY, HISTORY_TEMPLATES, 2), (THINKERS, THINKER_TEMPLATES, 2),
                                 (ARTS, ARTS_TEMPLATES, 2)]:
        for x in values:
            for template in rng.sample(templates, k):
                b.add("humanities", b.maybe_follow_up(template.format(x=x), HUMANITIES_FOLLOW_UP))
    for x, area in IDEAS:
        for template in rng.sample(IDEA_TEMPLATES, 2):
            b.add("humanities", b.maybe_follow_up(template.format(x=x, area=area), HUMANITIES_FOLLOW_UP))


def build2(seed: int = 0, reasoning_rounds: int = 11) -> list[dict]:
    """The second set of seed prompts (KINDS2), kinds interleaved line by line so that any first part of the file,
    answered, covers every kind. Needs no ShareGPT file."""
    b = _Builder(seed)
    _writing(b)
    _reasoning(b, reasoning_rounds)
    _coding(b)
    _stem(b)
    _humanities(b)
    by_kind = {kind: [item for item in b.items if item["category"] == kind] for kind in KINDS2}
    longest = max(len(items) for items in by_kind.values())
    return [items[i] for i in range(longest) for items in by_kind.values() if i < len(items)]


_WORD = re.compile(r"[a-z0-9]+")


def normalized_words(text: str) -> list[str]:
    """Lower-case words and numbers of `text` (punctuation, spacing and case do not matter)."""
    return _WORD.findall(text.lower())


def overlaps(prompts: dict[str, list[str]], texts: Iterable[tuple[str, str]], n: int = 12) -> list[tuple[str, str]]:
    """(prompt id, text source) for every prompt turn that occurs in one of `texts`: a turn of fewer than `n` words
    when a text equals it (normalized words), a longer one when a text shares any run of `n` words with it.

    prompts: {id: turns}, e.g. a held-out question file; texts: (source, text) pairs, e.g. every training prompt.
    Cost: one pass over the texts' words, joining only at words that start one of the prompts' n-grams."""
    short: dict[str, str] = {}
    grams: dict[str, str] = {}
    starts: set[str] = set()
    for key, turns in prompts.items():
        for turn in turns:
            words = normalized_words(turn)
            if len(words) < n:
                short[" ".join(words)] = key
            for i in range(len(words) - n + 1):
                grams[" ".join(words[i:i + n])] = key
                starts.add(words[i])
    found: dict[tuple[str, str], None] = {}
    for source, text in texts:
        words = normalized_words(text)
        whole = " ".join(words)
        if whole in short:
            found[(short[whole], source)] = None
        for i in range(len(words) - n + 1):
            if words[i] in starts:
                key = grams.get(" ".join(words[i:i + n]))
                if key is not None:
                    found[(key, source)] = None
    return list(found)


def write(items: list[dict], path: str | Path) -> Path:
    return write_text_atomic(path, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.seed_prompts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", type=int, choices=(1, 2), default=1,
                        help=f"1: {', '.join(KINDS)} (seed_kinds.jsonl); 2: {', '.join(KINDS2)} (seed_kinds2.jsonl)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write (default: {DEFAULT_OUT} or, for --set 2, {DEFAULT_OUT2})")
    add_flag(parser, "seed", default=0, note="here the draw of the prompts")
    add_flag(parser, "sharegpt")
    args = parser.parse_args(argv)
    items = build(args.seed, args.sharegpt) if args.set == 1 else build2(args.seed)
    kinds = KINDS if args.set == 1 else KINDS2
    out = args.out or (DEFAULT_OUT if args.set == 1 else DEFAULT_OUT2)
    write(items, out)
    counts = Counter(item["category"] for item in items)
    turns = sum(len(item["turns"]) > 1 for item in items)
    print(f"{out}: {len(items)} prompts ({', '.join(f'{k} {counts[k]}' for k in kinds)}), {turns} of two turns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
