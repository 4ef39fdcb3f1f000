"""Generates the shipped preference set: `python data/make_data.py` rewrites
`data/train.jsonl` and `data/eval.jsonl` byte for byte (fixed seeds, no outside text).

Every chosen response is verifiably better than its rejected one by a checkable rule:
- sort: "sort 7 2 9 4" -> chosen is the digits in ascending order, rejected the same
  digits in an unsorted order;
- max:  "max 3 8 1" -> chosen is the largest digit, rejected another, smaller one.
Eval pairs use their own seed, so most eval prompts never occur in training.
"""

import argparse
import json
import os
import random


def sort_pair(rng: random.Random) -> dict:
  digits = [rng.randrange(10) for _ in range(rng.randint(3, 8))]
  while len(set(digits)) < 2:  # need a wrong order to exist
    digits = [rng.randrange(10) for _ in range(len(digits))]
  ordered = sorted(digits)
  shuffled = digits[:]
  while shuffled == ordered:
    rng.shuffle(shuffled)
  return {"prompt": "sort " + " ".join(map(str, digits)) + "\n",
          "chosen": " ".join(map(str, ordered)),
          "rejected": " ".join(map(str, shuffled))}


def max_pair(rng: random.Random) -> dict:
  digits = [rng.randrange(10) for _ in range(rng.randint(3, 7))]
  while len(set(digits)) < 2:
    digits = [rng.randrange(10) for _ in range(len(digits))]
  best = max(digits)
  wrong = rng.choice([d for d in digits if d != best])
  return {"prompt": "max " + " ".join(map(str, digits)) + "\n",
          "chosen": str(best), "rejected": str(wrong)}


def make_split(n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  return [sort_pair(rng) if rng.random() < 2 / 3 else max_pair(rng) for _ in range(n)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--train_pairs", type=int, default=4096)
  parser.add_argument("--eval_pairs", type=int, default=512)
  args = parser.parse_args()
  for name, n, seed in (("train", args.train_pairs, 1234), ("eval", args.eval_pairs, 5678)):
    path = os.path.join(args.out_dir, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      for pair in make_split(n, seed):
        f.write(json.dumps(pair) + "\n")
    print(f"wrote {n} pairs to {path}")


if __name__ == "__main__":
  main()
