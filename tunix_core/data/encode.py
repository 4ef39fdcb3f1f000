"""One preference pair at a time: the shape check of a JSONL record (`pair_error`), its
token ids built the way TRL's `DPOTrainer` builds them (`encode_plain`, `encode_chat`),
and the fixed-length row they become (`build_row`).

Plain pairs (strings): the prompt and `prompt + response` are tokenized jointly, since a
BPE merges across the boundary, and the response is the joint ids after the prompt's
ids, then EOS (not added again when the text already ends with it). The pair's BOS is
the tokenizer's `bos_id` (none when it is None, as in Qwen). When the joint ids do not
start with the prompt's ids (a merged token spans the seam, as in the fixture BPE for
prompt "the " and response "quick": [the Ġ] vs [the Ġqu ick]), TRL would cut at the
prompt's length anyway, losing or duplicating text at the seam; we keep the prompt's
ids and take the separately tokenized response, so the row still spells out `prompt + response`
and the prompt stays the same for chosen and rejected, and we count the response
(`num_prefix_mismatch`). A SentencePiece-style tokenizer (a "▁" at the start of every
text) then gives one extra space at such a seam: "A: " + "Sure" becomes "A:  Sure".

Conversational pairs (TRL's message lists): the prompt is the chat template rendered
with `add_generation_prompt=True`; each response is the template rendered for
`prompt + [response]` without generation prompt, minus the prompt's ids. We add no BOS
or EOS: the template writes them (a leading BOS it writes is treated as the row's BOS,
so prompt truncation keeps it). On a mismatch the response is the tokenized text after
the longest common prefix of the two renderings, and the response is counted.
"""

import numpy as np

from tunix_kernels import IGNORE_INDEX
FIELDS = ("prompt", "chosen", "rejected")


class ChatTemplateError(ValueError):
  """The chat template failed to render a pair's messages."""


def pair_error(record: dict) -> str | None:
  """Why a JSON object is not a preference pair (string or message-list form), or None."""
  for field in FIELDS:
    if field not in record:
      return f"missing field {field!r}"
  if isinstance(record["prompt"], str):
    for field in FIELDS[1:]:
      if not isinstance(record[field], str):
        return f"field {field!r} must be a string, got {type(record[field]).__name__}"
    return None
  if not isinstance(record["prompt"], list):
    return (f"field 'prompt' must be a string or a list of messages, got "
            f"{type(record['prompt']).__name__}")
  if not record["prompt"]:
    return "field 'prompt' is an empty message list"
  for field in FIELDS:
    messages = record[field]
    if field != "prompt" and not (isinstance(messages, list) and len(messages) == 1):
      got = (f"{len(messages)} messages" if isinstance(messages, list)
             else type(messages).__name__)
      return (f"field {field!r} must be a list of one assistant message (the prompt is a "
              f"message list), got {got}")
    for i, m in enumerate(messages):
      if not (isinstance(m, dict) and isinstance(m.get("role"), str)
              and isinstance(m.get("content"), str)):
        return f"field {field!r} message {i} must be an object with string 'role' and 'content'"
    if field != "prompt" and messages[0]["role"] != "assistant":
      return f"field {field!r} must hold an 'assistant' message, got {messages[0]['role']!r}"
  return None


def _conversational(value) -> bool:
  """TRL's `is_conversational` of one field: a list whose first item is a message."""
  return isinstance(value, list) and bool(value) and isinstance(value[0], dict) \
      and "role" in value[0]


def maybe_extract_prompt(record: dict) -> dict:
  """`record` with its prompt extracted from `chosen` and `rejected` when it is implicit
  there, as TRL's `maybe_extract_prompt`: when there is no `prompt`, or one of the other
  format (a string prompt beside message-list responses). The prompt is the longest
  common prefix (of characters, or of messages); a string prompt leaves a space that
  ends it to the responses. Other columns are kept."""
  if "chosen" not in record or "rejected" not in record:
    return record
  chosen, rejected = record["chosen"], record["rejected"]
  prompt = record.get("prompt")
  if "prompt" in record and (not isinstance(prompt, (str, list))
                             or _conversational(chosen) == _conversational(prompt)):
    return record  # a prompt of the responses' format, or one pair_error names
  if not (isinstance(chosen, (str, list)) and type(chosen) is type(rejected)):
    return record  # pair_error names the field
  idx = 0
  for idx in range(min(len(chosen), len(rejected))):
    if chosen[idx] != rejected[idx]:
      if chosen[idx - 1] == " ":  # the space before the response stays with it
        idx -= 1
      break
  return {**record, "prompt": chosen[:idx], "chosen": chosen[idx:],
          "rejected": rejected[idx:]}


def _with_eos(ids: list[int], eos_id: int) -> list[int]:
  return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def encode_plain(tok, prompt: str, responses) -> tuple[list[int], list[int], list, int]:
  """`(bos, prompt_ids, [response_ids, ...], mismatches)` for string fields.

  `bos` is `[]` or `[bos_id]`; each response's ids end with EOS; `mismatches` counts the
  responses whose joint tokenization did not start with the prompt's ids.
  """
  bos = [] if tok.bos_id is None else [tok.bos_id]
  prompt_ids = tok.encode(prompt)
  out, mismatches = [], 0
  for response in responses:
    joint = tok.encode(prompt + response)
    if joint[:len(prompt_ids)] == prompt_ids:
      ids = joint[len(prompt_ids):]
    else:
      ids, mismatches = tok.encode(response), mismatches + 1
    out.append(_with_eos(ids, tok.eos_id))
  return bos, prompt_ids, out, mismatches


def _render(tok, messages: list, add_generation_prompt: bool) -> str:
  try:
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  except Exception as e:  # the template is user code: any failure is the data's
    raise ChatTemplateError(f"{type(e).__name__}: {e}") from None


def encode_chat(tok, prompt: list, responses) -> tuple[list[int], list[int], list, int]:
  """`(bos, prompt_ids, [response_ids, ...], mismatches)` for message lists: `prompt` a
  list of `{"role", "content"}` dicts, each response a list of assistant messages.

  Raises `ChatTemplateError` when the template fails on the messages.
  """
  prompt_text = _render(tok, prompt, True)
  prompt_ids = tok.encode(prompt_text)
  out, mismatches = [], 0
  for response in responses:
    full_text = _render(tok, prompt + response, False)
    joint = tok.encode(full_text)
    if joint[:len(prompt_ids)] == prompt_ids:
      out.append(joint[len(prompt_ids):])
      continue
    common = 0
    for a, b in zip(prompt_text, full_text):
      if a != b:
        break
      common += 1
    out.append(tok.encode(full_text[common:]))
    mismatches += 1
  bos = []
  if tok.bos_id is not None and prompt_ids[:1] == [tok.bos_id]:
    bos, prompt_ids = prompt_ids[:1], prompt_ids[1:]
  return bos, prompt_ids, out, mismatches


def build_row(bos: list[int], prompt_ids: list[int], response_ids: list[int], pad_id: int,
              max_length: int, max_prompt_length: int):
  """One row `(tokens, targets, loss_mask)`, each int32 `[max_length]`, or None.

  The sequence is `bos + prompt + response` (the response carrying its own end: EOS or
  the template's end of turn); `tokens` is it without its last id, `targets` it shifted
  left by one. The prompt keeps its last `max_prompt_length` ids (`bos` always kept, not
  counted); the response is cut at the end to fit. `loss_mask` is 1 where the target is
  a response id. Without BOS and prompt the first response id has nothing to be
  predicted from and is not scored. Returns None when no response id is scored.
  """
  prompt_ids = prompt_ids[max(0, len(prompt_ids) - max_prompt_length):]
  context = len(bos) + len(prompt_ids)
  seq = (bos + prompt_ids + response_ids)[:max_length + 1]
  n = len(seq) - 1  # tokens in the row
  first = max(context - 1, 0)  # target index of the first scored response id
  if n <= first:
    return None
  tokens = np.full(max_length, pad_id, np.int32)
  targets = np.full(max_length, IGNORE_INDEX, np.int32)
  loss_mask = np.zeros(max_length, np.int32)
  tokens[:n] = seq[:-1]
  targets[first:n] = seq[first + 1:]
  loss_mask[first:n] = 1
  return tokens, targets, loss_mask
