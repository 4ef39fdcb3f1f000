"""Data pipeline: row layout and masks by hand, truncation, drops, iterator state, bad input."""

import filecmp
import json
import os
import re
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from tunix_core import data

TOK = data.ByteTokenizer()
BOS, EOS, PAD, IGN = TOK.bos_id, TOK.eos_id, TOK.pad_id, data.IGNORE_INDEX
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, lines, name="pairs.jsonl"):
  path = tmp_path / name
  path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
  return str(path)


def _pair(p, c, r):
  return json.dumps({"prompt": p, "chosen": c, "rejected": r})


def test_row_layout_and_mask():
  # "ab" -> "xy": tokens BOS a b x y PAD.., targets a b x y EOS.., scored: x y EOS.
  tokens, targets, mask = data.encode_row(TOK.encode("ab"), TOK.encode("xy"), TOK, 8, 4)
  a, b, x, y = (ord(ch) for ch in "abxy")
  np.testing.assert_array_equal(tokens, [BOS, a, b, x, y, PAD, PAD, PAD])
  np.testing.assert_array_equal(targets, [IGN, IGN, x, y, EOS, IGN, IGN, IGN])
  np.testing.assert_array_equal(mask, [0, 0, 1, 1, 1, 0, 0, 0])
  assert targets[2] == x  # the first response token is scored


def test_truncation_prompt_left_response_right():
  # Prompt "abcdef" with max_prompt_length 3 keeps "def"; response "uvwxyz" in a row of 6
  # keeps 3 scored targets "u v w", with no EOS since the response was cut.
  tokens, targets, mask = data.encode_row(TOK.encode("abcdef"), TOK.encode("uvwxyz"), TOK, 6, 3)
  d, e, f, u, v, w = (ord(ch) for ch in "defuvw")
  np.testing.assert_array_equal(tokens, [BOS, d, e, f, u, v])
  np.testing.assert_array_equal(targets, [IGN, IGN, IGN, u, v, w])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])


def test_dataset_batches_and_drops(tmp_path):
  path = _write(tmp_path, [_pair("q1", "good", "bad"), _pair("q2", "", "bad"),
                           _pair("q3", "yes", "no"), ""])
  ds = data.load_dataset(path, TOK, max_length=16, max_prompt_length=8)
  assert len(ds) == 2 and ds.num_dropped == 1
  batch = data.take_pairs(ds, np.array([1, 0]))
  assert batch["tokens"].shape == (2, 2, 16)  # [pairs, (chosen, rejected), T]
  assert TOK.decode(batch["tokens"][0, 0]) == "q3yes"  # BOS and PAD decode to nothing
  decoded = [[TOK.decode(row[m > 0]) for row, m in zip(rows, masks)]
             for rows, masks in zip(batch["targets"], batch["loss_mask"])]
  assert decoded == [["yes", "no"], ["good", "bad"]]  # pair 1, then pair 0
  # Attention covers BOS + prompt + response (the EOS is only a target).
  np.testing.assert_array_equal(batch["attention_mask"].sum(-1), [[1 + 2 + 3, 1 + 2 + 2],
                                                                   [1 + 2 + 4, 1 + 2 + 3]])
  assert (batch["targets"][batch["loss_mask"] == 0] == IGN).all()


def test_a_large_file_logs_its_encoding_progress(tmp_path):
  path = _write(tmp_path, [_pair(f"q{i}", "a", "b") for i in range(10_000)])
  lines = []
  ds = data.load_dataset(path, TOK, max_length=16, max_prompt_length=8, log=lines.append)
  assert len(ds) == 10_000
  # A line for each tenth of the file's bytes a chunk of 2,000 pairs (a fifth) crosses.
  said = [re.fullmatch(rf"{path}: tokenized ([\d,]+) pairs \((\d+)% of the file\)", line)
          for line in lines]
  assert all(said), lines
  assert [m[1] for m in said] == ["2,000", "4,000", "6,000", "8,000", "10,000"]
  assert said[-1][2] == "100"


def test_iterator_is_deterministic_and_resumes(tmp_path):
  lines = [_pair(f"p{i}", f"c{i}", f"r{i}") for i in range(10)]
  ds = data.load_dataset(_write(tmp_path, lines), TOK, 16, 8)
  it = data.BatchIterator(ds, batch_size=3, seed=7)
  seen = [it.next_indices() for _ in range(3)]  # one epoch (10 // 3 = 3 batches)
  assert sorted(np.concatenate(seen).tolist()) == sorted(set(np.concatenate(seen).tolist()))
  state = it.get_state()
  assert state == {"epoch": 0, "position": 9}
  rest = [it.next_indices() for _ in range(4)]
  resumed = data.BatchIterator(ds, batch_size=3, seed=7, state=json.loads(json.dumps(state)))
  for want in rest:
    np.testing.assert_array_equal(resumed.next_indices(), want)
  assert resumed.get_state() == it.get_state() == {"epoch": 2, "position": 3}
  other = data.BatchIterator(ds, batch_size=3, seed=8)
  assert not all(np.array_equal(other.next_indices(), s) for s in seen)
  with pytest.raises(ValueError, match="invalid iterator state"):
    data.BatchIterator(ds, batch_size=3, seed=7, state={"epoch": 0, "position": 4})


def test_a_resume_on_changed_data_is_refused_or_restarts_its_epoch(tmp_path):
  old = data.load_dataset(_write(tmp_path, [_pair(f"p{i}", "c", "r") for i in range(10)],
                                 "old.jsonl"), TOK, 16, 8)
  new = data.load_dataset(_write(tmp_path, [_pair(f"q{i}", "c", "r") for i in range(7)],
                                 "new.jsonl"), TOK, 16, 8)
  it = data.BatchIterator(old, batch_size=3, seed=7, data_key="pairs-old")
  for _ in range(5):  # 3 batches of epoch 0, then 2 of epoch 1
    it.next_indices()
  state = json.loads(json.dumps(it.get_state()))  # as a checkpoint's metadata keeps it
  assert state == {"epoch": 1, "position": 6, "data_key": "pairs-old"}
  want = [it.next_indices() for _ in range(3)]
  # The same store, or a state saved without a key (by an earlier version): exactly where it was.
  for saved in (state, {"epoch": 1, "position": 6}):
    same = data.BatchIterator(old, 3, 7, saved, data_key="pairs-old")
    for batch in want:
      np.testing.assert_array_equal(same.next_indices(), batch)
    assert same.get_state() == it.get_state()  # the key is saved from then on
  # Another store: refused in one line naming the flag.
  with pytest.raises(data.DataError) as refused:
    data.BatchIterator(new, 3, 7, state, data_key="pairs-new")
  assert "\n" not in str(refused.value)
  assert "pairs-old" in str(refused.value) and "pairs-new" in str(refused.value)
  assert "pass --allow_data_change to restart epoch 1 from its start" in str(refused.value)
  # With the flag: epoch 1 from its first batch over the new pairs, which is where an
  # iterator over them is after its epoch 0 (7 pairs: 2 batches).
  fresh = data.BatchIterator(new, 3, 7)
  fresh.next_indices(), fresh.next_indices()
  restarted = data.BatchIterator(new, 3, 7, state, data_key="pairs-new",
                                 allow_data_change=True)
  for _ in range(3):  # into epoch 2
    np.testing.assert_array_equal(restarted.next_indices(), fresh.next_indices())
  assert restarted.get_state() == {"epoch": 2, "position": 3, "data_key": "pairs-new"}


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "chosen": "b"', "malformed JSON"),
    ('{"prompt": "a", "chosen": "b"}', "missing field 'rejected'"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "field 'chosen' must be a string"),
    ('["a", "b", "c"]', "expected a JSON object"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
  path = _write(tmp_path, [_pair("p", "c", "r"), line])
  with pytest.raises(data.DataError, match=f"pairs.jsonl:2: {message}"):
    data.read_jsonl(path)
  pairs, skipped = data.read_jsonl(path, skip_bad_lines=True)
  assert len(pairs) == 1 and skipped == 1


def test_empty_and_missing_files(tmp_path):
  with pytest.raises(data.DataError, match="empty.jsonl: no preference pairs"):
    data.read_jsonl(_write(tmp_path, [], "empty.jsonl"))
  with pytest.raises(data.DataError, match="no such data file"):
    data.read_jsonl(str(tmp_path / "nope.jsonl"))
  with pytest.raises(data.DataError, match="all 1 pairs were dropped"):
    data.load_dataset(_write(tmp_path, [_pair("p", "", "r")]), TOK, 16, 8)
  with pytest.raises(ValueError, match="max_prompt_length"):
    data.load_dataset(_write(tmp_path, [_pair("p", "c", "r")]), TOK, 8, 8)


def test_shipped_data_regenerates_identically(tmp_path):
  subprocess.run([sys.executable, os.path.join(REPO, "data", "make_data.py"),
                  "--out_dir", str(tmp_path)], check=True, capture_output=True)
  for name in ("train.jsonl", "eval.jsonl"):
    assert filecmp.cmp(tmp_path / name, os.path.join(REPO, "data", name), shallow=False)
  pairs, _ = data.read_jsonl(os.path.join(REPO, "data", "eval.jsonl"))
  for p in pairs:  # the rule that makes chosen better holds on every pair
    digits = [int(x) for x in p["prompt"].split()[1:]]
    if p["prompt"].startswith("sort"):
      assert p["chosen"] == " ".join(map(str, sorted(digits))) != p["rejected"]
      assert sorted(p["rejected"].split()) == sorted(p["chosen"].split())
    else:
      assert int(p["chosen"]) == max(digits) > int(p["rejected"])


def test_shipped_chat_data_regenerates_and_never_trains_on_a_probe_prompt(tmp_path):
  subprocess.run([sys.executable, os.path.join(REPO, "data", "make_chat_data.py"),
                  "--out_dir", str(tmp_path)], check=True, capture_output=True)
  for name in ("chat_train.jsonl", "chat_eval.jsonl"):
    assert filecmp.cmp(tmp_path / name, os.path.join(REPO, "data", name), shallow=False)
  with open(os.path.join(REPO, "data", "probe_prompts.txt"), encoding="utf-8") as f:
    probes = {line.strip() for line in f if line.strip()}
  pairs, _ = data.read_jsonl(os.path.join(REPO, "data", "chat_train.jsonl"))
  prompts = {p["prompt"][0]["content"] for p in pairs}
  assert len(pairs) == 1536 and not prompts & probes
  assert all(p["chosen"] != p["rejected"] for p in pairs)


# --- Hugging Face tokenizers, TRL's preference formats -----------------------------------

HF_TOKENIZER = os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer")  # ChatML BPE, no BOS
TRL_FIXTURE = os.path.join(REPO, "tests", "fixtures", "trl", "expected.json")


def _hf_tok(model_dir=HF_TOKENIZER):
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from tunix_core.hf import tokenizer as hf_tokenizer  # pylint: disable=g-import-not-at-top
  return hf_tokenizer.HFTokenizer(model_dir)


def _trl_fixture():
  with open(TRL_FIXTURE, encoding="utf-8") as f:
    return json.load(f)


def _msgs(*role_content):
  return [{"role": r, "content": c} for r, c in role_content]


def _expected_row(bos, prompt_ids, response_ids, pad, max_length):
  """The documented layout, by hand: seq = bos + prompt + response (no truncation)."""
  seq = bos + prompt_ids + response_ids
  n, first = len(seq) - 1, len(bos) + len(prompt_ids) - 1
  tokens = seq[:-1] + [pad] * (max_length - n)
  targets = [IGN] * first + seq[first + 1:] + [IGN] * (max_length - n)
  mask = [0] * first + [1] * (n - first) + [0] * (max_length - n)
  return tokens, targets, mask, [1] * n + [0] * (max_length - n)


def _assert_rows(ds, i, bos, prompt_ids, responses, pad):
  for j, response in enumerate(responses):  # j: chosen, rejected
    want = _expected_row(bos, prompt_ids, response, pad, ds.tokens.shape[-1])
    for name, w in zip(("tokens", "targets", "loss_mask", "attention_mask"), want):
      np.testing.assert_array_equal(getattr(ds, name)[i, j], w, err_msg=f"pair {i} {name}")


def _trl_response(want, key):
  """The response ids we build: TRL's joint split, or the response alone on a mismatch."""
  return want[f"{key}_ids"] if want[f"{key}_prefix_match"] else want[f"{key}_alone_ids"]


def test_rows_match_trl_construction_recorded_by_transformers(tmp_path):
  fixture = _trl_fixture()
  tok = _hf_tok()
  path = _write(tmp_path, [json.dumps(p, ensure_ascii=False) for p in fixture["pairs"]])
  ds = data.load_dataset(path, tok, max_length=96, max_prompt_length=64,
                         vocab_size=tok.vocab_size)
  assert len(ds) == len(fixture["pairs"]) and ds.num_dropped == 0
  for i, want in enumerate(fixture["expected"]):
    _assert_rows(ds, i, [], want["prompt_ids"],
                 [_trl_response(want, k) for k in ("chosen", "rejected")], tok.pad_id)
  mismatched = sum(not w[f"{k}_prefix_match"] for w in fixture["expected"]
                   for k in ("chosen", "rejected"))
  assert ds.num_prefix_mismatch == mismatched == 3


@pytest.mark.slow  # imports transformers (when installed)
def test_live_trl_construction_with_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "make_trl_fixtures", os.path.join(REPO, "tests", "make_trl_fixtures.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  hf_tok = transformers.AutoTokenizer.from_pretrained(HF_TOKENIZER)
  fixture = _trl_fixture()
  pairs = fixture["pairs"] + [  # and pairs the fixture does not hold
      {"prompt": _msgs(("user", "a new question, never seen")),
       "chosen": _msgs(("assistant", "  spaces and  doubles")),
       "rejected": _msgs(("assistant", "no"))},
      {"prompt": "quick brown", "chosen": " fox jumps", "rejected": " dog"}]
  expected = [script.reference(hf_tok, p) for p in pairs]
  assert expected[:len(fixture["pairs"])] == fixture["expected"]  # the fixture is current
  ds = data.load_dataset(_write(tmp_path, [json.dumps(p) for p in pairs]), _hf_tok(), 96, 64)
  for i, want in enumerate(expected):
    _assert_rows(ds, i, [], want["prompt_ids"],
                 [_trl_response(want, k) for k in ("chosen", "rejected")], hf_tok.pad_token_id)


def test_plain_pairs_split_the_joint_tokens_at_the_seam(tmp_path):
  tok = _hf_tok()
  ids = {s: tok.encode(s) for s in ("Hello", "Hello ", "Hello world", " world", "world",
                                    "the ", "the quick", "quick")}
  # One text, two seams: "Hello" | " world" and "Hello " | "world" both split the joint
  # ids [He ll o Ġ wor ld], 3 or 4 ids in.
  assert ids["Hello world"] == ids["Hello"] + ids[" world"] == ids["Hello "] + ids["world"]
  # "the " | "quick": the joint ids [the Ġqu ick] do not start with the prompt's [the Ġ];
  # TRL's cut would leave [ick]; we keep [the Ġ] and the response alone, [qu ick].
  assert ids["the quick"][:len(ids["the "])] != ids["the "]
  path = _write(tmp_path, [_pair("Hello", " world", " world"), _pair("Hello ", "world", "quick"),
                           _pair("the ", "quick", "quick<|im_end|>")])
  ds = data.load_dataset(path, tok, 16, 8)
  eos = [tok.eos_id]
  _assert_rows(ds, 0, [], ids["Hello"], [ids[" world"] + eos] * 2, tok.pad_id)
  _assert_rows(ds, 1, [], ids["Hello "], [ids["world"] + eos, ids["quick"] + eos], tok.pad_id)
  _assert_rows(ds, 2, [], ids["the "], [ids["quick"] + eos] * 2, tok.pad_id)  # one EOS only
  assert ds.num_prefix_mismatch == 3  # "Hello quick", and both responses of "the "


def _metaspace_tokenizer(tmp_path):
  """A SentencePiece-style BPE (Llama 2's `Metaspace`: a text's start gets a "▁"), with
  BOS <s> (1) and EOS </s> (2)."""
  tokenizers = pytest.importorskip("tokenizers")
  pieces = ["<unk>", "<s>", "</s>", "▁", "H", "e", "l", "o", "w", "r", "d"]
  merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("▁", "Hello"),
            ("w", "o"), ("wo", "r"), ("wor", "l"), ("worl", "d"), ("▁", "world")]
  vocab = {p: i for i, p in enumerate(pieces + ["".join(m) for m in merges])}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
  tok.add_special_tokens(["<s>", "</s>"])
  d = tmp_path / "metaspace"
  d.mkdir()
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  return _hf_tok(str(d)), vocab


def test_joint_split_avoids_the_space_a_separate_encoding_prepends(tmp_path):
  # "Hello" | "world" (no space): alone, "world" would be "▁world", a word of its own;
  # in the joint "▁Helloworld" = [▁Hello, world] the split gives "world", as TRL does.
  tok, v = _metaspace_tokenizer(tmp_path)
  assert tok.encode("world") == [v["▁world"]] and tok.bos_id == 1 and tok.eos_id == 2
  assert tok.encode("Helloworld") == [v["▁Hello"], v["world"]]
  ds = data.load_dataset(_write(tmp_path, [_pair("Hello", "world", " world")]), tok, 8, 4)
  _assert_rows(ds, 0, [1], [v["▁Hello"]], [[v["world"], 2], [v["▁world"], 2]], tok.pad_id)
  assert ds.num_prefix_mismatch == 0


def _with_bos_tokenizer(tmp_path, template_prefix="{{ bos_token }}"):
  """The fixture tokenizer with `<|endoftext|>` (id 0) as BOS, written by the template."""
  d = tmp_path / "tok_bos"
  d.mkdir()
  (d / "tokenizer.json").write_bytes(open(os.path.join(HF_TOKENIZER, "tokenizer.json"),
                                          "rb").read())
  config = json.load(open(os.path.join(HF_TOKENIZER, "tokenizer_config.json")))
  config.update(bos_token="<|endoftext|>", pad_token=None,
                chat_template=template_prefix + config["chat_template"])
  (d / "tokenizer_config.json").write_text(json.dumps(config))
  return _hf_tok(str(d))


def test_bos_only_when_the_tokenizer_has_one_and_kept_by_truncation(tmp_path):
  # No BOS and an empty prompt: the first response id has nothing before it to be scored
  # from, so scoring starts at the second ("wor" predicts "ld").
  ds = data.load_dataset(_write(tmp_path, [_pair("", "world", "world")], "nobos.jsonl"),
                         _hf_tok(), 8, 4)
  wor, ld = _hf_tok().encode("world")
  np.testing.assert_array_equal(ds.tokens[0, 0], [wor, ld, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(ds.targets[0, 0], [ld, 2, IGN, IGN, IGN, IGN, IGN, IGN])
  np.testing.assert_array_equal(ds.attention_mask[0, 0], [1, 1, 0, 0, 0, 0, 0, 0])
  tok = _with_bos_tokenizer(tmp_path)
  assert tok.bos_id == 0 and tok.pad_id == tok.eos_id == 2
  ds = data.load_dataset(_write(tmp_path, [_pair("Hello", " world", " world")]), tok, 16, 8)
  _assert_rows(ds, 0, [0], tok.encode("Hello"), [tok.encode(" world") + [2]] * 2, 2)
  # A conversational prompt cut to its last 4 ids keeps the BOS its template wrote.
  prompt = _msgs(("user", "Hi?"))
  line = json.dumps({"prompt": prompt, "chosen": _msgs(("assistant", "4")),
                     "rejected": _msgs(("assistant", "5"))})
  ds = data.load_dataset(_write(tmp_path, [line], "chat.jsonl"), tok, 16, 4)
  prompt_ids = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True))
  assert prompt_ids[0] == 0 and len(prompt_ids) > 5
  for j, digit in enumerate("45"):
    response = tok.encode(f"{digit}<|im_end|>\n")
    want = _expected_row([0], prompt_ids[-4:], response, 2, 16)
    np.testing.assert_array_equal(ds.tokens[0, j], want[0])
    np.testing.assert_array_equal(ds.loss_mask[0, j], want[2])


def test_chat_template_override_and_mismatch_fallback(tmp_path):
  tok = _hf_tok()
  # A template whose generation prompt opens a "<think>" the rendered reply lacks (as
  # DeepSeek-R1's does): the response is the text after the common prefix.
  jinja = tmp_path / "think.jinja"
  jinja.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
                   " + '<|im_end|>\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n<think>' }}{% endif %}")
  think = data.with_chat_template(tok, str(jinja))
  assert think.chat_template == jinja.read_text() and tok.chat_template != think.chat_template
  line = json.dumps({"prompt": _msgs(("user", "Hi?")), "chosen": _msgs(("assistant", "4")),
                     "rejected": _msgs(("assistant", ""))})
  path = _write(tmp_path, [line, line.replace('"content": ""', '"content": "5"')])
  ds = data.load_dataset(path, think, 48, 32)
  assert len(ds) == 1 and ds.num_dropped == 1  # the empty reply is dropped
  prompt_ids = tok.encode("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n<think>")
  _assert_rows(ds, 0, [], prompt_ids, [tok.encode(f"{d}<|im_end|>\n") for d in "45"],
               tok.pad_id)
  assert ds.num_prefix_mismatch == 2
  assert data.with_chat_template(tok, "auto") is tok
  assert data.with_chat_template(tok, "none").chat_template is None
  assert data.with_chat_template(TOK, "none") is TOK
  with pytest.raises(data.DataError, match="ByteTokenizer cannot render chat templates"):
    data.with_chat_template(TOK, str(jinja))
  with pytest.raises(data.DataError, match="nope.jinja: cannot read the chat template"):
    data.with_chat_template(tok, str(tmp_path / "nope.jinja"))


def test_conversational_pair_without_chat_template(tmp_path):
  line = json.dumps({"prompt": _msgs(("user", "Hi?")), "chosen": _msgs(("assistant", "a")),
                     "rejected": _msgs(("assistant", "b"))})
  path = _write(tmp_path, [_pair("p", "c", "r"), line])
  for tok in (TOK, data.with_chat_template(_hf_tok(), "none")):
    with pytest.raises(data.DataError, match="pairs.jsonl:2: a conversational pair "
                       r"\(message lists\) needs a chat template and the tokenizer has none"):
      data.load_dataset(path, tok, 16, 8)
  assert _hf_tok().chat_template is not None


def test_failing_chat_template_names_the_line(tmp_path):
  tok = _hf_tok()
  jinja = tmp_path / "strict.jinja"
  jinja.write_text("{% if messages[0]['role'] == 'system' %}"
                   "{{ raise_exception('no system messages') }}{% endif %}{{ 'x' }}")
  line = json.dumps({"prompt": _msgs(("system", "s"), ("user", "u")),
                     "chosen": _msgs(("assistant", "a")), "rejected": _msgs(("assistant", "b"))})
  with pytest.raises(data.DataError, match="pairs.jsonl:1: the chat template failed "
                     r"\(TokenizerError: chat template: no system messages\)"):
    data.load_dataset(_write(tmp_path, [line]), data.with_chat_template(tok, str(jinja)), 16, 8)


_A = '[{"role": "assistant", "content": "a"}]'
_U = '[{"role": "user", "content": "u"}]'


@pytest.mark.parametrize("line,message", [
    (f'{{"prompt": {_U}, "chosen": "a", "rejected": {_A}}}',
     r"field 'chosen' must be a list of one assistant message \(the prompt is a message list\), "
     "got str"),
    (f'{{"prompt": {_U}, "chosen": {_A}, "rejected": [{_A[1:-1]}, {_A[1:-1]}]}}',
     "field 'rejected' must be a list of one assistant message .* got 2 messages"),
    (f'{{"prompt": {_U}, "chosen": {_U}, "rejected": {_A}}}',
     "field 'chosen' must hold an 'assistant' message, got 'user'"),
    (f'{{"prompt": [{{"role": "user"}}], "chosen": {_A}, "rejected": {_A}}}',
     "field 'prompt' message 0 must be an object with string 'role' and 'content'"),
    (f'{{"prompt": {_U}, "chosen": [{{"role": "assistant", "content": [1]}}], '
     f'"rejected": {_A}}}', "field 'chosen' message 0 must be an object"),
    (f'{{"prompt": [{_U[1:-1]}, "hi"], "chosen": {_A}, "rejected": {_A}}}',
     "field 'prompt' message 1 must be an object"),
    (f'{{"prompt": [], "chosen": {_A}, "rejected": {_A}}}',
     "field 'prompt' is an empty message list"),
    (f'{{"prompt": 5, "chosen": {_A}, "rejected": {_A}}}',
     "field 'prompt' must be a string or a list of messages, got int"),
    (f'{{"prompt": "p", "chosen": {_A}, "rejected": "r"}}',
     "field 'chosen' must be a string, got list"),
])
def test_malformed_message_lists_name_file_and_line(tmp_path, line, message):
  json.loads(line)  # the line itself is valid JSON
  path = _write(tmp_path, [_pair("p", "c", "r"), line])
  with pytest.raises(data.DataError, match=f"pairs.jsonl:2: {message}"):
    data.read_jsonl(path)
  pairs, skipped = data.read_jsonl(path, skip_bad_lines=True)
  assert len(pairs) == 1 and skipped == 1
  assert len(data.load_dataset(path, TOK, 16, 8, skip_bad_lines=True)) == 1


def test_token_ids_beyond_the_model_vocabulary(tmp_path):
  tok = _hf_tok()
  path = _write(tmp_path, [_pair("a", "b", "c"), _pair("Hello", " world", " doubles")])
  low = max(tok.encode("abc") + [tok.eos_id, tok.pad_id])
  high = max(tok.encode("Hello world doubles"))
  assert low < 100 < high
  with pytest.raises(data.DataError, match=f"pairs.jsonl:2: token id {high} is not below "
                     "the model's vocabulary size 100"):
    data.load_dataset(path, tok, 16, 8, vocab_size=100)
  assert len(data.load_dataset(path, tok, 16, 8, vocab_size=high + 1)) == 2
  with pytest.raises(data.DataError, match="pairs.jsonl: the tokenizer's pad id 258 is not "
                     "below the model's vocabulary size 258"):
    data.load_dataset(path, TOK, 16, 8, vocab_size=258)
  with pytest.raises(data.DataError, match="x.jsonl:1: token id 257 is not below"):
    data.load_dataset(_write(tmp_path, [_pair("a", "b", "c")], "x.jsonl"), _Pad0(), 16, 8,
                      vocab_size=257)


class _Pad0(data.ByteTokenizer):
  pad_id = 0


def test_byte_rows_of_the_shipped_data_are_bos_prompt_response_eos():
  # Byte tokenizer rows stay exactly [BOS] + UTF-8 prompt + UTF-8 response + EOS.
  path = os.path.join(REPO, "data", "eval.jsonl")
  pairs, _ = data.read_jsonl(path)
  ds = data.load_dataset(path, TOK, 48, 24, vocab_size=TOK.vocab_size)
  assert len(ds) == len(pairs) and ds.num_prefix_mismatch == ds.num_dropped == 0
  assert all(a.dtype == np.int32 for a in (ds.tokens, ds.targets, ds.loss_mask))
  for i, p in enumerate(pairs):
    prompt = list(p["prompt"].encode())[-24:]
    for j, key in enumerate(("chosen", "rejected")):
      seq = ([BOS] + prompt + list(p[key].encode()) + [EOS])[:49]
      n = len(seq) - 1
      assert ds.tokens[i, j].tolist() == seq[:-1] + [PAD] * (48 - n)
      assert ds.targets[i, j].tolist() == [IGN] * len(prompt) + seq[1 + len(prompt):] + \
          [IGN] * (48 - n)


class _NoBos(data.ByteTokenizer):
  bos_id = None


def test_token_store_sizes_equal_the_rows_and_it_holds_no_padding(tmp_path):
  """A token store's statistics (from its offsets alone) equal `packing.pair_sizes` of
  its rows under both layouts, also for prompts of nothing (no BOS, empty prompt: the
  rows share a prefix only if the responses start alike); its files hold at most 1.25x
  the rows' real tokens as int32, plus 8 bytes of offsets per run (and each file's
  128-byte `.npy` header)."""
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  from tunix_core.data import packing  # pylint: disable=g-import-not-at-top
  from tunix_core.data import store  # pylint: disable=g-import-not-at-top
  path = _write(tmp_path, [_pair("", "same", "sane"), _pair("", "abc", "xyz"),
                           _pair("q", "a long answer", "b"), _pair("", "x" * 40, "y")])
  for tok, src in ((_NoBos(), path), (TOK, os.path.join(REPO, "data", "train.jsonl"))):
    out = str(tmp_path / type(tok).__name__)
    pairs = build.build(src, tok, out, 24, 8)
    batch = pairs.take(np.arange(len(pairs)))
    for share in (False, True):
      want, got = packing.pair_sizes(batch, share), pairs.sizes(share)
      for field in ("tokens", "scored", "longest"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    assert pairs.num_tokens(np.arange(len(pairs))) == batch["attention_mask"].sum()
    on_disk = sum(os.path.getsize(os.path.join(out, f)) for f in store.FILES)
    offsets = os.path.getsize(os.path.join(out, "offsets.npy"))
    assert offsets == 128 + 8 * (3 * len(pairs) + 1)
    assert on_disk - offsets - 2 * 128 <= 1.25 * 4 * batch["attention_mask"].sum(), on_disk


@pytest.mark.slow  # starts two pools of worker processes
def test_token_store_of_worker_processes_equals_one_process(tmp_path, monkeypatch):
  """Two workers on chunks of 100 lines write the very files one process writes, and a
  bad line in a worker's chunk still names its path and line (or is skipped)."""
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  from tunix_core.data import store  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(build, "_WORKER_START_S", 0.0)  # workers for the byte tokenizer too
  lines = open(os.path.join(REPO, "data", "train.jsonl"), encoding="utf-8").read().splitlines()
  path = _write(tmp_path, lines[:1100] + ["{not json"] + lines[1100:1500])
  with pytest.raises(data.DataError, match=re.escape(f"{path}:1101: malformed JSON")):
    build.build(path, TOK, str(tmp_path / "bad"), 64, 32, workers=2, chunk_pairs=100)
  one = build.build(path, TOK, str(tmp_path / "one"), 64, 32, True, workers=1)
  two = build.build(path, TOK, str(tmp_path / "two"), 64, 32, True, workers=2,
                    chunk_pairs=100)
  assert one.num_skipped_lines == two.num_skipped_lines == 1 and len(one) > 1000
  for f in store.FILES:
    assert filecmp.cmp(os.path.join(one.path, f), os.path.join(two.path, f), shallow=False)


@pytest.mark.parametrize("in_flight", [2, 4, 16])
def test_chunks_are_read_a_bound_ahead_of_their_results(in_flight):
  """The pool's chunks are read lazily: when the k-th result comes back exactly
  min(k + in_flight - 1, all) have been read, whatever the pool's size (here a thread
  pool whose tasks finish out of order), and the results come in the items' order."""
  from multiprocessing.pool import ThreadPool  # pylint: disable=g-import-not-at-top
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  in_order = build._in_order  # pylint: disable=protected-access
  n, read = 20, []

  def items():
    for x in range(n):
      read.append(x)
      yield x, f"tag{x}"

  def fn(x):
    time.sleep((x * 7 % 5) / 1000)  # later items finish first
    return x * x

  with ThreadPool(8) as pool:
    got = []
    for k, out in enumerate(in_order(fn, items(), pool, in_flight), start=1):
      assert len(read) == min(k + in_flight - 1, n), k
      got.append(out)
  assert got == [(x * x, f"tag{x}") for x in range(n)]
  read.clear()
  for k, _ in enumerate(in_order(fn, items(), None, in_flight), start=1):
    assert len(read) == k  # no pool: one chunk at a time


def test_fast_tokenizing_never_starts_workers(tmp_path, monkeypatch):
  """The shipped data's 3 chunks take the byte tokenizer milliseconds, less than a
  worker takes to start (it imports JAX): all 8 workers asked for, none is started."""
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  from tunix_core.data import store  # pylint: disable=g-import-not-at-top
  src = os.path.join(REPO, "data", "train.jsonl")
  with open(src, encoding="utf-8") as f:
    assert sum(1 for _ in f) > 2 * 2000  # three chunks of 2,000 lines
  one = build.build(src, TOK, str(tmp_path / "one"), 64, 32, workers=1)

  def no_pool(method):
    pytest.fail(f"a {method} pool was started")

  monkeypatch.setattr(build, "multiprocessing", types.SimpleNamespace(get_context=no_pool))
  eight = build.build(src, TOK, str(tmp_path / "eight"), 64, 32, workers=8)
  for f in store.FILES:
    assert filecmp.cmp(os.path.join(one.path, f), os.path.join(eight.path, f), shallow=False)


class _TwoWorkers(data.ByteTokenizer):
  """The byte tokenizer, `slow_s` slower on its first text in the calling process; in a
  worker it records the worker's process id in `folder`, then waits (60 s at most) until
  two workers have: one worker alone would leave one id."""

  def __init__(self, folder: str, slow_s: float):
    self.folder, self.slow_s, self.caller = folder, slow_s, os.getpid()

  def encode(self, text: str) -> list[int]:
    mark = os.path.join(self.folder, str(os.getpid()))
    if os.getpid() == self.caller:
      time.sleep(self.slow_s)
      self.slow_s = 0
    elif not os.path.exists(mark):
      open(mark, "w").close()  # pylint: disable=consider-using-with
      deadline = time.monotonic() + 60
      while len(os.listdir(self.folder)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return super().encode(text)


@pytest.mark.slow  # starts a pool of worker processes
def test_a_slow_file_of_three_chunks_uses_two_workers(tmp_path):
  """A first chunk slow enough that the two left pay for starting workers: both workers
  encode them (their ids recorded), and the store equals one process's."""
  from tunix_core.data import build  # pylint: disable=g-import-not-at-top
  from tunix_core.data import store  # pylint: disable=g-import-not-at-top
  path = _write(tmp_path, [_pair(f"q{i:02d}", "yes", "no") for i in range(12)])
  ids = tmp_path / "ids"
  ids.mkdir()
  # Two chunks left over two workers pay when the first took more than one start.
  tok = _TwoWorkers(str(ids), build._WORKER_START_S + 0.2)  # pylint: disable=protected-access
  two = build.build(path, tok, str(tmp_path / "two"), 64, 32, workers=2, chunk_pairs=4)
  workers = {int(name) for name in os.listdir(ids)}
  assert len(workers) == 2 and os.getpid() not in workers
  one = build.build(path, TOK, str(tmp_path / "one"), 64, 32, workers=1)
  assert len(one) == 12
  for f in store.FILES:
    assert filecmp.cmp(os.path.join(one.path, f), os.path.join(two.path, f), shallow=False)
