"""Generates the shipped conversational preference set for real pretrained models
(`configs/smollm2_dpo.flags`): `python data/make_chat_data.py` rewrites
`data/chat_train.jsonl` and `data/chat_eval.jsonl` byte for byte (fixed seeds).

Records are in TRL's conversational format: `prompt` a list of messages, `chosen` and
`rejected` one assistant message each. The chosen answer is checkably right and the
rejected one wrong:
- sort: "Sort these numbers from smallest to largest: 7, 2, 9, 4." -> chosen the
  numbers in ascending order, rejected the same numbers out of order;
- max:  "Which is the largest number: 3, 8, 1?" -> chosen the largest, rejected another;
- general (training only, appended after the 1024 number pairs): short questions of
  general knowledge and simple instructions (capitals, sums, counts, colours, science,
  one-sentence writing) with the right answer chosen and a wrong or off-topic one
  rejected. They are the replay that keeps the model's general answers while it learns
  the two number tasks; none of them is a prompt of `data/probe_prompts.txt`.
Eval pairs (number tasks only) use their own seed, so most eval prompts never occur in
training.
"""

import argparse
import json
import os
import random


def _numbers(rng: random.Random) -> list[int]:
  while True:
    numbers = [rng.randrange(1, 50) for _ in range(rng.randint(3, 6))]
    if len(set(numbers)) == len(numbers):
      return numbers


def _pair(question: str, chosen: str, rejected: str) -> dict:
  return {"prompt": [{"role": "user", "content": question}],
          "chosen": [{"role": "assistant", "content": chosen}],
          "rejected": [{"role": "assistant", "content": rejected}]}


def sort_pair(rng: random.Random) -> dict:
  numbers = _numbers(rng)
  ordered = sorted(numbers)
  shuffled = numbers[:]
  while shuffled == ordered:
    rng.shuffle(shuffled)
  fmt = lambda xs: ", ".join(map(str, xs))
  return _pair(f"Sort these numbers from smallest to largest: {fmt(numbers)}.",
               fmt(ordered), fmt(shuffled))


def max_pair(rng: random.Random) -> dict:
  numbers = _numbers(rng)
  wrong = rng.choice([n for n in numbers if n != max(numbers)])
  return _pair(f"Which is the largest number: {', '.join(map(str, numbers))}?",
               f"The largest number is {max(numbers)}.", f"The largest number is {wrong}.")


CAPITALS = {"Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid", "Japan": "Tokyo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Russia": "Moscow", "China": "Beijing",
            "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna", "Norway": "Oslo",
            "Sweden": "Stockholm", "Poland": "Warsaw", "Ireland": "Dublin",
            "Kenya": "Nairobi", "Peru": "Lima", "Argentina": "Buenos Aires",
            "Thailand": "Bangkok", "India": "New Delhi", "England": "London",
            "Turkey": "Ankara", "Australia": "Canberra", "Mexico": "Mexico City"}
COUNTS = [("hours", "a day", 24), ("minutes", "an hour", 60), ("seconds", "a minute", 60),
          ("months", "a year", 12), ("days", "a year", 365), ("legs", "a spider", 8),
          ("sides", "a triangle", 3), ("sides", "a square", 4), ("wheels", "a bicycle", 2),
          ("continents", "the world", 7), ("players", "a soccer team", 11)]
COLOURS = {"grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
           "a ripe tomato": "red", "chocolate": "brown", "a lemon": "yellow",
           "milk": "white", "a carrot": "orange"}
SCIENCE = [("What is the largest planet in our solar system?", "The largest planet is Jupiter.",
            "The largest planet is Mars."),
           ("Which planet is closest to the Sun?", "Mercury is the planet closest to the Sun.",
            "Neptune is the planet closest to the Sun."),
           ("What do bees make?", "Bees make honey.", "Bees make milk."),
           ("What is frozen water called?", "Frozen water is called ice.",
            "Frozen water is called steam."),
           ("At what temperature does water boil at sea level?",
            "Water boils at 100 degrees Celsius at sea level.",
            "Water boils at 10 degrees Celsius at sea level."),
           ("What gas do people need to breathe?", "People need oxygen to breathe.",
            "People need helium to breathe.")]
SENTENCES = {"dogs": "Dogs are loyal companions that love to play outside.",
             "the sea": "The sea stretches blue and wide beyond the shore.",
             "rain": "Rain taps gently on the window on a grey afternoon.",
             "books": "Books let us travel to new worlds without leaving home.",
             "the moon": "The moon lights up the night sky with a soft glow.",
             "trees": "Trees give us shade, fruit and fresh air."}


GENERAL = 512  # general pairs after the number pairs: a third of the training set


def general_pair(rng: random.Random) -> dict:
  kind = rng.randrange(6)
  if kind == 0:
    country = rng.choice(sorted(CAPITALS))
    wrong = rng.choice([c for k, c in sorted(CAPITALS.items()) if k != country])
    answer = f"The capital of {country} is {{}}."
    return _pair(f"What is the capital of {country}?", answer.format(CAPITALS[country]),
                 answer.format(wrong))
  if kind == 1:
    a, b = 3, 4
    while (a, b) == (3, 4):  # the probe's own sum
      a, b = rng.randrange(1, 20), rng.randrange(1, 20)
    wrong = a + b + rng.choice([-2, -1, 1, 2, 10])
    return _pair(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"{a} + {b} = {wrong}.")
  if kind == 2:
    unit, whole, n = rng.choice(COUNTS)
    wrong = n + rng.choice([-1, 1, 2, n])
    return _pair(f"How many {unit} are there in {whole}?", f"There are {n} {unit} in {whole}.",
                 f"There are {wrong} {unit} in {whole}.")
  if kind == 3:
    thing = rng.choice(sorted(COLOURS))
    wrong = rng.choice(sorted({c for c in COLOURS.values()} - {COLOURS[thing]} | {"purple"}))
    name = thing[0].upper() + thing[1:]
    return _pair(f"What color is {thing}?", f"{name} is {COLOURS[thing]}.", f"{name} is {wrong}.")
  if kind == 4:
    return _pair(*rng.choice(SCIENCE))
  topic = rng.choice(sorted(SENTENCES))
  other = rng.choice([t for t in sorted(SENTENCES) if t != topic])
  return _pair(f"Write one short sentence about {topic}.", SENTENCES[topic], SENTENCES[other])


def make(n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  return [(sort_pair if rng.random() < 0.5 else max_pair)(rng) for _ in range(n)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)))
  args = parser.parse_args()
  general_rng = random.Random(13)
  for name, pairs in (("chat_train.jsonl", make(1024, 11)
                       + [general_pair(general_rng) for _ in range(GENERAL)]),
                      ("chat_eval.jsonl", make(64, 12))):
    with open(os.path.join(args.out_dir, name), "w") as f:
      for pair in pairs:
        f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
  main()
