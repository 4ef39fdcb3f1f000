"""Online DPO (`--online_samples`, `--reward_fn`, `--init_from`): pairs built from scored
samples against hand-built ones, the shipped rewards by hand, exact resume after a
SIGKILL, the same samples under FSDP on 8 devices as on one, and bad input in one line."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import runs
from tunix_core import generate as generate_lib
from tunix_core.checkpoints import init_from
from tunix_core.checkpoints import store as checkpoint
from tunix_core.data import encode as data_encode
from tunix_core.data import sampled_pairs as pairs_lib
from tunix_core.online import reward_fn
from tunix_core.online import rewards
from tunix_core.online import sampler as sampler_lib
from tunix_core.run import loop as train
from tunix_core.run import source as source_lib
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib
from tunix_core.training.config import ConfigError

REPO = runs.REPO
REWARD = "online_rewards:checksum"
TIMING = ("tokens_per_sec", "mfu", "online/sample_share")


def test_pairs_are_the_best_and_worst_sample_and_ties_stay_padding():
  prompts = [np.array([256, 7, 8]), np.array([256, 9])]
  samples = np.array([[[1, 2, 257], [3, 257, 0], [4, 5, 6]],
                      [[1, 257, 0], [2, 257, 0], [3, 257, 0]]], np.int32)
  lengths = np.array([[3, 2, 3], [2, 2, 2]])
  scores = np.array([[0.5, 2.0, -1.0], [1.0, 1.0, 1.0]])
  batch = pairs_lib.build(prompts, samples, lengths, scores, pad_id=258, max_length=8)
  # Prompt 0: sample 1 (score 2) is chosen, sample 2 (score -1) rejected, as
  # `build_row` lays out a prompt and its response.
  for c, response in enumerate(([3, 257], [4, 5, 6])):
    tokens, targets, loss = data_encode.build_row([], [256, 7, 8], response, 258, 8, 8)
    np.testing.assert_array_equal(batch["tokens"][0, c], tokens)
    np.testing.assert_array_equal(batch["targets"][0, c], targets)
    np.testing.assert_array_equal(batch["loss_mask"][0, c], loss)
    assert batch["attention_mask"][0, c].sum() == 3 + len(response) - 1
  # Prompt 1: all three tie: padding, scored nowhere.
  assert not batch["loss_mask"][1].any() and not batch["attention_mask"][1].any()
  assert (batch["tokens"][1] == 258).all()


def test_the_data_chosen_wins_only_above_every_sample_and_is_never_rejected():
  """`--online_data_chosen`: candidate 2 (the data's chosen response) after 2 samples."""
  prompts = [np.array([256, 7])] * 4
  samples = np.array([[[1, 257, 0], [2, 257, 0], [9, 9, 257]]] * 4, np.int32)
  lengths = np.array([[2, 2, 3]] * 4)
  scores = np.array([[0.0, 0.0, 1.0],   # both samples miss: the data's answer vs sample 0
                     [1.0, 0.0, 1.0],   # a sample as good: the sample
                     [1.0, 1.0, 1.0],   # nothing to prefer
                     [1.0, 0.5, -1.0]])  # the data's answer scored lowest: not rejected
  batch = pairs_lib.build(prompts, samples, lengths, scores, pad_id=258, max_length=6,
                          samples=2)
  want = {0: ([9, 9, 257], [1, 257]), 1: ([1, 257], [2, 257]), 3: ([1, 257], [2, 257])}
  for b, responses in want.items():
    for c, response in enumerate(responses):
      tokens, _, _ = data_encode.build_row([], [256, 7], response, 258, 6, 6)
      np.testing.assert_array_equal(batch["tokens"][b, c], tokens, err_msg=f"{b} {c}")
  assert not batch["loss_mask"][2].any()
  np.testing.assert_array_equal(pairs_lib.choose(scores, 2)[2], [False, False, True, False])


def test_shipped_rewards_by_hand():
  prompts = ["sort 3 1 2\n"] * 4 + ["max 4 9 2\n"] * 3 + ["hello\n"]
  completions = ["1 2 3", "1 3 2", "cat", "3 2 1 0", "9", "4", "x", "1"]
  # "1 3 2": 3 of 3 digits from the prompt, 1 in place: 0.4 + 0.35 / 3; "3 2 1 0": 3 of
  # 4 (the longer) from the prompt, "2" in place; "4": from the prompt, not the answer.
  want = [1.0, 0.4 + 0.35 / 3, 0.0, 0.4 * 3 / 4 + 0.35 / 4, 1.0, 0.4, 0.0, 0.0]
  np.testing.assert_allclose(rewards.quickstart(prompts, completions), want)
  assert rewards.exact_match(prompts, completions) == [1, 0, 0, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("fn, message", [
    (lambda p, c: 1 / 0, "at step 7 raised ZeroDivisionError"),
    (lambda p, c: [1.0], "at step 7 returned 1 scores for 2 completions"),
    (lambda p, c: [1.0, float("inf")], "at step 7 returned the non-finite score inf"),
    (lambda p, c: None, "at step 7 returned NoneType")])
def test_a_bad_reward_is_one_line_naming_it_and_the_step(fn, message):
  with pytest.raises(reward_fn.RewardError, match=message):
    reward_fn.score(fn, "--reward_fn=m:f", "step 7", prompts=["a", "b"],
                    completions=["c", "d"])


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """A run to start from: 2 offline steps of the tiny preset, saved."""
  out = tmp_path_factory.mktemp("start")
  train.train(runs.config(out, steps=2, save_every=2), **runs.QUIET)
  return str(out)


def _online(out, start, **kw):
  return runs.config(out, **{**dict(init_from=start, online_samples=2, reward_fn=REWARD,
                                    online_max_new_tokens=8), **kw})


@pytest.mark.slow
def test_init_from_loads_the_saved_policy_and_refuses_what_does_not_fit(start, tmp_path):
  cfg = _online(tmp_path, start)
  steps = runs.steps(dataclasses.replace(cfg, online_samples=0), jax.devices()[:1])
  got = init_from.load_params(start, steps.mcfg, steps.logical_shardings(), np.float32)
  ckpt = checkpoint.Checkpointer(os.path.join(start, "checkpoints"), read_only=True)
  meta = ckpt.read_meta(2)
  assert checkpoint.fingerprints({"params": got}) == {
      k: v for k, v in meta["fingerprints"].items() if k.startswith("['params']")}
  assert init_from.spec(start) == f"{os.path.abspath(start)}:2"
  with pytest.raises(ConfigError, match="no complete step 5 .*saved: \\[2\\]"):
    init_from.spec(f"{start}:5")
  wide = runs.steps(dataclasses.replace(cfg, online_samples=0, model="tiny_tp"),
                    jax.devices()[:1])
  with pytest.raises(ConfigError, match="vocab_size=259, this run.s has vocab_size=260"):
    init_from.load_params(start, wide.mcfg, wide.logical_shardings(), np.float32)


@pytest.mark.slow
def test_fsdp_on_8_devices_samples_what_one_device_does(start, tmp_path):
  # The data's chosen responses (16 ids at most) join the samples: a reward they can beat.
  cfg = _online(tmp_path, start, online_data_chosen=True, online_max_new_tokens=16,
                reward_fn="online_rewards:ones")
  train_set, _ = source_lib.load_data(cfg, lambda *_: None)
  idx = np.arange(8)
  got = []
  for fsdp, devices in ((False, jax.devices()[:1]), (True, jax.devices())):
    c = dataclasses.replace(cfg, fsdp=fsdp)
    plan = plan_lib.make_plan(c, devices, plan_lib.data_sizes(c, [train_set]))
    steps = step_lib.make_steps(plan, devices)
    params = steps.policy_params(source_lib.initial_params(c, steps), None)
    sampler = sampler_lib.OnlineSampler(c, steps, train_set, source_lib.tokenizer(c), (257,))
    batch, metrics = sampler(3, params, idx)
    got.append((batch, metrics))
  for key in got[0][0]:
    np.testing.assert_array_equal(got[0][0][key], got[1][0][key], err_msg=key)
  assert got[0][1] == got[1][1]
  assert 0 < got[0][1]["online/tie_rate"] < 1  # some pairs, some ties: both paths ran
  assert 0 < got[0][1]["online/data_chosen"] < 1


def _trainer(cfg, *extra, script="trainer.py"):
  flags = [f"--{k}={v}" for k, v in dataclasses.asdict(cfg).items() if v != ""]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=os.path.join(REPO, "tests"))
  return subprocess.run([sys.executable, os.path.join(REPO, script), *extra, *flags],
                        env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_online_climbs_the_reward_offline_dpo_does_not(start, tmp_path):
  """12 steps from the same start, evaluated by the greedy answers' reward (the count of
  "1"s in 8 new ids): online DPO on the policy's own scored samples reaches the top,
  offline DPO on the data's pairs stays near zero."""
  evals = tmp_path / "eval.jsonl"
  evals.write_text("".join(open(os.path.join(REPO, "data", "eval.jsonl")).readlines()[:32]))
  got = {}
  for k in (4, 0):
    cfg = _online(tmp_path / str(k), start, online_samples=k, reward_fn="online_rewards:ones",
                  steps=12, eval_data=str(evals), eval_every=12, save_every=0)
    train.train(cfg, **runs.QUIET)
    got[k] = [r["eval/reward"] for r in runs.rows(cfg.output_dir) if "eval/reward" in r][-1]
  assert got[4] > 4 > 1 > got[0], got


@pytest.mark.slow
def test_killed_and_resumed_online_run_equals_the_straight_run(start, tmp_path):
  cfg = _online(tmp_path / "straight", start, steps=4, save_every=2)
  train.train(cfg, **runs.QUIET)
  killed = dataclasses.replace(cfg, output_dir=str(tmp_path / "killed"))
  proc = _trainer(killed, "--kill_at=train step 4", script="tests/fault_trainer.py")
  assert proc.returncode == -9, proc.stderr[-2000:]
  train.train(killed, **runs.QUIET)
  strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
  want, got = strip(runs.rows(cfg.output_dir)), strip(runs.rows(killed.output_dir))
  assert [r["step"] for r in want] == [1, 2, 3, 4]
  assert got == want  # bit-exact: the same samples, scores, pairs and updates


@pytest.mark.slow
def test_bad_online_settings_end_in_one_line_with_status_1(start, tmp_path):
  cases = [(dict(reward_fn="online_rewards:missing"),
            "--reward_fn='online_rewards:missing' cannot be imported: AttributeError"),
           (dict(reward_fn="online_rewards:NOT_CALLABLE"), "is a int, not a function"),
           (dict(online_samples=1), "--online_samples=1: online DPO needs K >= 2"),
           (dict(reference="precomputed"), "--reference=precomputed cannot serve"),
           (dict(online_data_chosen=True, online_max_new_tokens=1),
            "--online_data_chosen: the longest chosen response of --train_data (")]
  for kw, message in cases:
    proc = _trainer(_online(tmp_path / "a", start, **kw))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("trainer.py: error: ") and message in lines[0]
    assert "compiled" not in proc.stdout  # refused before any compile
  # A reward that fails at the third step ends the run after step 2's checkpoint.
  out = tmp_path / "c"
  proc = _trainer(_online(out, start, steps=6, save_every=2,
                          reward_fn="online_rewards:raises_at_third_call"))
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "trainer.py: error: --reward_fn=online_rewards:raises_at_third_call at step 3 raised "
      "KeyError: 'no score for this one'"]
  assert sorted(os.listdir(out / "checkpoints")) == ["2"]



def _one_step(cfg, devices, ds, batch):
  """Params and metrics after one step of `batch` from the tiny preset's seed-0 init."""
  plan = dataclasses.replace(plan_lib.make_plan(cfg, devices, plan_lib.data_sizes(cfg, [ds])),
                             padded_pairs=True)  # as an online run's
  steps = step_lib.make_steps(plan, devices)
  state = steps.init_state(jax.random.PRNGKey(0))
  ref = jax.tree.map(lambda x: x.copy(), state["params"])
  state, metrics = steps.train_step(state, ref, steps.put_batch(batch))
  return jax.device_get(steps.logical_params(state["params"])), jax.device_get(metrics)


@pytest.mark.slow  # two step compiles
def test_tied_pairs_change_nothing_across_micro_batches_and_devices(tmp_path):
  """A batch of 8 with 4 tied prompts (padding pairs, unevenly over 2 devices and 2
  micro-batches) updates as the 4 untied pairs alone on one device do: SGD, so the
  update is the gradient itself."""
  from tunix_core import data as data_lib  # pylint: disable=g-import-not-at-top
  cfg = runs.config(tmp_path, batch_size=8, optimizer="sgd", learning_rate=0.5,
                    loss_type="sigmoid,ipo", grad_accum_steps="2")
  ds = data_lib.load_dataset(cfg.train_data, data_lib.ByteTokenizer(), cfg.max_length,
                             cfg.max_prompt_length)
  tied = np.array([False, True, True, True, False, True, False, False])
  batch = data_lib.take_pairs(ds, np.arange(8))
  for key, fill in (("tokens", 0), ("targets", data_encode.IGNORE_INDEX), ("loss_mask", 0),
                    ("attention_mask", 0)):
    batch[key][tied] = fill
  got, got_m = _one_step(cfg, jax.devices()[:2], ds, batch)
  alone = {k: v[~tied] for k, v in data_lib.take_pairs(ds, np.arange(8)).items()}
  want, want_m = _one_step(dataclasses.replace(cfg, batch_size=4, grad_accum_steps="1"),
                           jax.devices()[:1], ds, alone)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)
  for k in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert float(got_m["pairs"]) == 4.0


def test_a_step_without_a_valid_pair_logs_no_loss(tmp_path):
  from tunix_core.run import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  lines = []
  writer = metrics_lib.MetricsWriter(str(tmp_path), log=lines.append)
  progress = metrics_lib.Progress(writer, lines.append, start=0, total=2)
  zero = {"loss": 0.0, "rewards/margins": 0.0, "rewards/accuracies": 0.0, "logps/chosen": 0.0,
          "grad_norm": 0.0, "learning_rate": 1e-3}
  progress.defer(1, dict(zero, pairs=0.0))
  progress.flush()
  progress.defer(2, dict(zero, loss=0.5, pairs=3.0))
  progress.flush()
  progress.close()
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert "loss" not in rows[0] and "rewards/margins" not in rows[0], rows[0]
  assert rows[0]["grad_norm"] == 0.0 and rows[1]["loss"] == 0.5
  assert any("no valid pair" in l for l in lines), lines


def test_chat_answers_end_at_their_eos_and_trl_rewards_run_unchanged(tmp_path):
  """ChatML (the fixture tokenizer: EOS <|im_end|>, then "\\n" in the template): a sample
  equal to the data's answer is an exact match, the data's chosen candidate equals that
  sample, and a TRL reward reads message lists and the rows' `solution` column."""
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from tunix_core.data import build as data_build  # pylint: disable=g-import-not-at-top
  from tunix_core.hf import tokenizer as hf_tokenizer  # pylint: disable=g-import-not-at-top
  tok = hf_tokenizer.HFTokenizer(os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer"))
  msg = lambda role, text: [{"role": role, "content": text}]
  rows = [{"prompt": msg("user", f"{a}+{b}?"), "chosen": msg("assistant", str(a + b)),
           "rejected": msg("assistant", "0"), "solution": str(a + b)}
          for a, b in ((1, 2), (3, 4), (2, 2))]
  path = tmp_path / "chat.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  store = data_build.build(str(path), tok, str(tmp_path / "store"), 48, 32)
  eos = (tok.eos_id,)
  for _, chosen, _ in store.runs(np.arange(3)):  # the template's "\n" after <|im_end|>
    assert chosen[-2] == tok.eos_id and chosen[-1] != tok.eos_id
  cfg = runs.config(tmp_path / "run", train_data=str(path), eval_data=str(path),
                    batch_size=2, online_samples=2, online_data_chosen=True,
                    online_max_new_tokens=8, reward_fn="online_rewards:trl_accuracy")
  steps = type("Steps", (), dict(mesh=jax.make_mesh((1,), ("data",)), batch_axes="data"))
  sampler = sampler_lib.OnlineSampler(cfg, steps, store, tok, eos)
  answers = {tuple(p): generate_lib.until_eos(c, eos) for p, c, _ in store.runs(np.arange(3))}

  def perfect(params, prompts, repeat, key, sampling, length):
    """Every sample is the data's answer, ended by EOS, then padding."""
    out = np.zeros((len(prompts), repeat, 8), np.int32)
    for i, p in enumerate(prompts):
      out[i, :, :len(answers[tuple(p)])] = answers[tuple(p)]
    return out, np.array([[len(answers[tuple(p)])] * repeat for p in prompts])

  sampler._generate = perfect
  assert sampler.evaluate(None, store) == {"eval/reward": 1.0, "eval/exact_match": 1.0}
  runs_ = store.runs(np.arange(2))
  samples, lengths = perfect(None, [p for p, _, _ in runs_], 2, None, None, None)
  candidates, candidate_lengths = sampler._with_data_chosen(runs_, samples, lengths)
  np.testing.assert_array_equal(candidates[:, 0], candidates[:, 2])
  np.testing.assert_array_equal(candidate_lengths[:, 0], candidate_lengths[:, 2])
  batch, metrics = sampler(1, None, np.arange(2))
  assert metrics["online/tie_rate"] == 1.0 and not batch["loss_mask"].any()
  # TRL's missing_eos_penalty: a sample cut before its EOS loses it, the data's answer not.
  cut = dataclasses.replace(cfg, online_missing_eos_penalty=0.25)
  sampler = sampler_lib.OnlineSampler(cut, steps, store, tok, eos)
  rows_ = [rows[0], rows[1]]
  scores = sampler._scores(rows_, candidates, candidate_lengths - [[1, 0, 1]], "step 2")
  np.testing.assert_array_equal(scores, [[0.75, 1.0, 1.0]] * 2)


@pytest.mark.slow
def test_a_resume_keeps_its_reference_when_the_source_run_saves_again(tmp_path):
  """Run B starts from run A's newest step (2); A then trains on and saves step 4; B
  resumed still trains against A's step 2, exactly as a straight B from A:2 does. With
  that step deleted (A's --keep), B's resume is refused in one line."""
  a, b, straight = tmp_path / "a", tmp_path / "b", tmp_path / "straight"
  train.train(runs.config(a, steps=2, save_every=2), **runs.QUIET)
  train.train(runs.config(b, steps=2, save_every=2, init_from=str(a)), **runs.QUIET)
  train.train(runs.config(a, steps=4, save_every=2), **runs.QUIET)
  train.train(runs.config(b, steps=4, save_every=2, init_from=str(a)), **runs.QUIET)
  train.train(runs.config(straight, steps=4, save_every=2, init_from=f"{a}:2"), **runs.QUIET)
  got, want = runs.losses(b), runs.losses(straight)
  assert got == want, (got, want)
  meta = checkpoint.Checkpointer(os.path.join(b, "checkpoints"), read_only=True).read_meta(4)
  assert meta["source"]["init_from"] == f"{os.path.abspath(a)}:2"
  shutil.rmtree(os.path.join(a, "checkpoints", "2"))
  with pytest.raises(ConfigError, match=r"cannot resume from step 4: its reference, "
                     r"--init_from=.*:2, is gone"):
    train.train(runs.config(b, steps=6, save_every=2, init_from=str(a)), **runs.QUIET)


def _two_processes(cfg) -> list:
  """`(status, stdout, stderr)` of trainer.py as two processes of one device each over
  loopback (`tests/` on their path for the reward)."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  flags = [f"--{k}={v}" for k, v in dataclasses.asdict(cfg).items() if v != ""]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu", PYTHONPATH=os.path.join(REPO, "tests"))
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(REPO, "trainer.py"), *flags,
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  return [(p,) + p.communicate(timeout=600) for p in procs]


@pytest.mark.slow
def test_two_processes_train_as_one_and_a_raising_reward_ends_both_with_status_1(
    start, tmp_path):
  """Online DPO over two loopback processes (the reward scored on the first, its float32
  scores broadcast) follows the curve of one process on two devices; a reward that
  raises at its third call ends both processes with status 1 and its one line."""
  two = _online(tmp_path / "two", start, steps=3)
  for p, _, err in _two_processes(two):
    assert p.returncode == 0, err[-3000:]
  one = _online(tmp_path / "one", start, steps=3)
  train.train(one, devices=jax.devices()[:2], **runs.QUIET)
  got, want = runs.losses(tmp_path / "two"), runs.losses(tmp_path / "one")
  assert got.keys() == want.keys() and got
  np.testing.assert_allclose([got[k] for k in sorted(got)], [want[k] for k in sorted(want)],
                             rtol=1e-5)
  bad = _online(tmp_path / "bad", start, steps=4, reward_fn="online_rewards:raises_at_third_call")
  for p, _, err in _two_processes(bad):
    assert p.returncode == 1, (p.returncode, err[-3000:])
    assert ("--reward_fn=online_rewards:raises_at_third_call at step 3 raised KeyError"
            in err), err[-3000:]
