"""Generates the shipped conversational preference set for real pretrained models
(`configs/smollm2_dpo.flags`): `python data/make_chat_data.py` rewrites
`data/chat_train.jsonl` and `data/chat_eval.jsonl` byte for byte (fixed seeds).

Records are in TRL's conversational format: `prompt` a list of messages, `chosen` and
`rejected` one assistant message each. The chosen answer is checkably right and the
rejected one wrong:
- sort: "Sort these numbers from smallest to largest: 7, 2, 9, 4." -> chosen the
  numbers in ascending order, rejected the same numbers out of order;
- max:  "Which is the largest number: 3, 8, 1?" -> chosen the largest, rejected another.
Eval pairs use their own seed, so most eval prompts never occur in training.
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


def make(n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  return [(sort_pair if rng.random() < 0.5 else max_pair)(rng) for _ in range(n)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)))
  args = parser.parse_args()
  for name, n, seed in (("chat_train.jsonl", 1024, 11), ("chat_eval.jsonl", 64, 12)):
    with open(os.path.join(args.out_dir, name), "w") as f:
      for pair in make(n, seed):
        f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
  main()
