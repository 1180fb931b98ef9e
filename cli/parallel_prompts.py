"""The requests `ggrun parallel` serves, made as llama-parallel makes them (examples/parallel/parallel.cpp):
its system prompt, its nine built-in questions (or the lines of -f), each request's question drawn by a
Mersenne Twister seeded 1234 (the same draws as its std::mt19937, so both tools serve the same requests
in the same order), up to --junk earlier question-and-answer turns before it, and the turn format
"User:\\n<question>\\nAssistant:\\n" whose answer ends where the model starts the next "User:".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SYSTEM_PROMPT = """Transcript of a never ending dialog, where the User interacts with an Assistant.
The Assistant is helpful, kind, honest, good at writing, and never fails to answer the User's requests immediately and with precision.

User:
Recommend a nice restaurant in the area.
Assistant:
I recommend the restaurant "The Golden Duck". It is a 5 star restaurant with a great view of the city. The food is delicious and the service is excellent. The prices are reasonable and the portions are generous. The restaurant is located at 123 Main Street, New York, NY 10001. The phone number is (212) 555-1234. The hours are Monday through Friday from 11:00 am to 10:00 pm. The restaurant is closed on Saturdays and Sundays.
User:
Who is Richard Feynman?
Assistant:
Richard Feynman was an American physicist who is best known for his work in quantum mechanics and particle physics. He was awarded the Nobel Prize in Physics in 1965 for his contributions to the development of quantum electrodynamics. He was a popular lecturer and author, and he wrote several books, including "Surely You're Joking, Mr. Feynman!" and "What Do You Care What Other People Think?".
"""

QUESTIONS = [
    "What is the meaning of life?",
    "Tell me an interesting fact about llamas.",
    "What is the best way to cook a steak?",
    "Are you familiar with the Special Theory of Relativity and can you explain it to me?",
    "Recommend some interesting books to read.",
    "What is the best way to learn a new language?",
    "How to get a job at Google?",
    "If you could have any superpower, what would it be?",
    "I want to learn how to play the piano. What would be the best way to do it?",
]

# the "junk" turns llama-parallel puts before a request's question (--junk N: up to N-1 of them)
JUNK = [
    ("What is the tallest mountain in the world?", "The tallest mountain in the world is Mount Everest."),
    ("Who was the first person to win two Nobel Prizes?", "Marie Curie was the first person to win two Nobel Prizes."),
    ("Which country invented paper?", "Paper was invented in China."),
    ("What organ is primarily responsible for pumping blood throughout the body?",
     "The heart is the organ responsible for pumping blood."),
    ("Which planet is known for its prominent ring system?", "Saturn is known for its prominent ring system."),
    ("Who directed the movie 'Inception'?", "Christopher Nolan directed the movie 'Inception'."),
    ("What is the freezing point of water in Fahrenheit?", "The freezing point of water in Fahrenheit is 32°F."),
    ("Which animal is known to have the longest lifespan?",
     "The bowhead whale is known to have the longest lifespan among mammals."),
    ("What language has the most native speakers worldwide?",
     "Mandarin Chinese has the most native speakers in the world."),
    ("What is the capital city of Canada?", "The capital city of Canada is Ottawa."),
    ("Who is credited with inventing the World Wide Web?",
     "Tim Berners-Lee is credited with inventing the World Wide Web."),
    ("Which metal is liquid at room temperature?", "Mercury is the metal that is liquid at room temperature."),
    ("What is the term for an animal that eats both plants and meat?",
     "An animal that eats both plants and meat is called an omnivore."),
    ("Who painted 'The Starry Night'?", "'The Starry Night' was painted by Vincent van Gogh."),
    ("What gas do humans exhale that plants use for photosynthesis?",
     "Humans exhale carbon dioxide, which plants use in photosynthesis."),
    ("What year did World War II end?", "World War II ended in 1945."),
    ("Which continent has the most countries?", "Africa is the continent with the most countries."),
    ("Who wrote the novel 'Frankenstein'?", "The novel 'Frankenstein' was written by Mary Shelley."),
    ("What does DNA stand for?", "DNA stands for Deoxyribonucleic Acid."),
    ("What is the main ingredient in traditional Japanese miso soup?",
     "The main ingredient in traditional Japanese miso soup is fermented soybean paste."),
]

STOP_TEXT = "User:"  # a response ends where the model begins the next turn


def format_turn(question: str) -> str:
    """One request's last turn, as llama-parallel writes it."""
    return f"User:\n{question}\nAssistant:\n"


@dataclass(frozen=True)
class Request:
    question: str  # the request's question (what llama-parallel prints as Input)
    text: str  # the whole prompt text the client sends: junk turns, then the question's turn


def make_requests(n: int, questions: list[str], n_junk: int = 1, system_text: str = "") -> list[Request]:
    """llama-parallel's n requests in order: for each, question = questions[rng() % len], then
    rng() % n_junk junk turns each drawn by rng() % len(JUNK); system_text (an unshared system prompt)
    starts every prompt."""
    rng = np.random.RandomState(1234)  # legacy seeding is std::mt19937(1234); 32-bit draws are its outputs

    def draw() -> int:
        return int(rng.randint(0, 2**32, dtype=np.uint32))

    n_junk = max(1, n_junk)
    out = []
    for _ in range(n):
        question = questions[draw() % len(questions)]
        text = system_text
        for _ in range(draw() % n_junk):
            q, a = JUNK[draw() % len(JUNK)]
            text += f"User:\n{q}\nAssistant:\n {a}\n"
        out.append(Request(question, text + format_turn(question)))
    return out
