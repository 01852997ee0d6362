"""Write examples/sft/tiny_chat.jsonl: a tiny chat set for supervised fine-tuning on a CPU (examples/sft_cpu.sh).

    python examples/sft/make_tiny_chat.py [--output examples/sft/tiny_chat.jsonl]

Every line is one conversation in the messages layout ({"messages": [{"role", "content"}, ...]}): short questions
about arithmetic, the days of the week, the months, colours, capitals, opposites and counting, answered in one
plain sentence; some open with a system turn, some go on for a second question, and some call a tool (a weather
lookup or a calculator) and answer from its result. The text is written for this project and is in the public
domain. The set is the same on every run (a fixed seed), so the shipped file is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import os
import random

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
            "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "Greece": "Athens", "Ireland": "Dublin", "Portugal": "Lisbon", "Poland": "Warsaw", "Chile": "Santiago",
            "Australia": "Canberra"}
COLOURS = {"the sky on a clear day": "blue", "fresh grass": "green", "a ripe banana": "yellow", "snow": "white",
           "coal": "black", "a ripe tomato": "red", "an orange": "orange", "a lemon": "yellow",
           "milk": "white", "the sea on a sunny day": "blue", "a fire engine": "red", "a frog": "green"}
MIXES = {("red", "yellow"): "orange", ("blue", "yellow"): "green", ("red", "blue"): "purple",
         ("red", "white"): "pink", ("black", "white"): "grey"}
OPPOSITES = {"hot": "cold", "big": "small", "up": "down", "day": "night", "fast": "slow", "open": "closed",
             "old": "new", "light": "dark", "wet": "dry", "early": "late", "full": "empty", "happy": "sad"}
FACTS = [("How many days are there in a week?", "There are seven days in a week."),
         ("How many months are there in a year?", "There are twelve months in a year."),
         ("How many hours are there in a day?", "There are twenty-four hours in a day."),
         ("How many minutes are there in an hour?", "There are sixty minutes in an hour."),
         ("How many legs does a spider have?", "A spider has eight legs."),
         ("How many legs does a cat have?", "A cat has four legs."),
         ("How many legs does a bird have?", "A bird has two legs."),
         ("What do bees make?", "Bees make honey."),
         ("Which planet do we live on?", "We live on the planet Earth."),
         ("What is frozen water called?", "Frozen water is called ice."),
         ("Where does the sun rise?", "The sun rises in the east."),
         ("Where does the sun set?", "The sun sets in the west.")]
WEATHER = [("Oslo", "snow", -3), ("Cairo", "sun", 31), ("Dublin", "rain", 11), ("Lima", "cloud", 19),
           ("Tokyo", "rain", 17), ("Madrid", "sun", 26), ("Ottawa", "snow", -8), ("Athens", "sun", 24)]
WEATHER_WORDS = {"snow": "snowing", "sun": "sunny", "rain": "raining", "cloud": "cloudy"}
SYSTEMS = ["You are a helpful assistant. Answer in one short sentence.", "You answer briefly and plainly.",
           "You are a friendly helper for children learning facts."]
TOOL_SYSTEM = "To use a tool, write: call: name(argument)."


def number(n: int) -> str:
    """A number in words (minus and up to ninety-nine), as the answers write it."""
    if n < 0:
        return "minus " + number(-n)
    if n <= 20:
        return NUMBER_WORDS[n]
    tens = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"][n // 10]
    return tens if n % 10 == 0 else f"{tens}-{NUMBER_WORDS[n % 10]}"


def questions(rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs of every kind."""
    pairs = []
    for _ in range(40):
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        pairs.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    for _ in range(24):
        a, b = rng.randint(5, 20), rng.randint(1, 5)
        pairs.append((f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."))
    for _ in range(24):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        pairs.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}."))
    for n in rng.sample(range(1, 20), 10):
        pairs.append((f"What number comes after {n}?", f"{n + 1} comes after {n}."))
    for n in rng.sample(range(1, 30), 12):
        pairs.append((f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}."))
    for i, day in enumerate(DAYS):
        pairs.append((f"What day comes after {day}?", f"{DAYS[(i + 1) % 7]} comes after {day}."))
        pairs.append((f"What day comes before {day}?", f"{DAYS[i - 1]} comes before {day}."))
    for i, month in enumerate(MONTHS):
        pairs.append((f"Which month comes after {month}?", f"{MONTHS[(i + 1) % 12]} comes after {month}."))
    pairs += [("What is the first day of the week?", "Monday is the first day of the week."),
              ("Which days are the weekend?", "Saturday and Sunday are the weekend."),
              ("What is the first month of the year?", "January is the first month of the year."),
              ("What is the last month of the year?", "December is the last month of the year.")]
    for country, capital in CAPITALS.items():
        pairs.append((f"What is the capital of {country}?", f"The capital of {country} is {capital}."))
    for thing, colour in COLOURS.items():
        pairs.append((f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}."))
    for (first, second), mixed in MIXES.items():
        pairs.append((f"What colour do you get when you mix {first} and {second}?",
                      f"Mixing {first} and {second} gives {mixed}."))
    for word, opposite in OPPOSITES.items():
        pairs.append((f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."))
    for _ in range(10):
        n = rng.randint(3, 8)
        pairs.append((f"Count to {number(n)}.", ", ".join(number(k).capitalize() for k in range(1, n + 1)) + "."))
    pairs += FACTS
    return pairs


def tool_conversations(rng: random.Random) -> list[list[dict]]:
    """Conversations that call the weather tool or the calculator and answer from the result."""
    calls = [(f"What is the weather in {city}?", f"weather({city})", f"{sky}, {degrees} degrees",
              f"It is {WEATHER_WORDS[sky]} in {city}, {number(degrees)} degrees.") for city, sky, degrees in WEATHER]
    for _ in range(8):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        calls.append((f"Please work out {a} times {b}.", f"calculator({a} * {b})", str(a * b),
                      f"{a} times {b} is {a * b}."))
    return [[{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": question},
             {"role": "assistant", "content": f"call: {call}"}, {"role": "tool", "content": f"{call}: {result}"},
             {"role": "assistant", "content": answer}] for question, call, result, answer in calls]


def conversations(seed: int = 0) -> list[list[dict]]:
    """Every conversation of the set, in a fixed order: one question each, some after a system turn, some with a
    second question, and the tool calls among them."""
    rng = random.Random(seed)
    pairs = questions(rng)
    rng.shuffle(pairs)
    out = []
    i = 0
    while i < len(pairs):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
        turns = 2 if rng.random() < 0.2 and i + 1 < len(pairs) else 1
        for question, answer in pairs[i:i + turns]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(messages)
        i += turns
    for conversation in tool_conversations(rng):
        out.insert(rng.randrange(len(out) + 1), conversation)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_chat.jsonl"))
    args = parser.parse_args(argv)
    chats = conversations()
    with open(args.output, "w", encoding="utf-8") as file:
        for messages in chats:
            file.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.output}: {len(chats)} conversations, {sum(len(m) for m in chats)} turns")


if __name__ == "__main__":
    main()
