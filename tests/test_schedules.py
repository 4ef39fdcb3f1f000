"""`--lr_schedule` and `--warmup_ratio` (`optim.make_schedule`) against hand-computed
rates and, where installed, transformers' `get_scheduler` step for step."""

import math

import numpy as np
import pytest

from tunix_core.training import config as config_lib
from tunix_core.training import optim

# transformers' names of our schedules.
HF_NAMES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def _rates(schedule: str, steps: int, **warmup) -> np.ndarray:
  cfg = optim.OptimizerConfig(learning_rate=2.0, lr_schedule=schedule, steps=steps, **warmup)
  fn = optim.make_schedule(cfg)
  return np.array([float(fn(count)) for count in range(steps)])


def test_rates_by_hand():
  # 10 steps, warmup 2: 0, 1, then from the peak 2 down over the 8 steps left.
  np.testing.assert_allclose(_rates("linear", 10, warmup_steps=2),
                             [0, 1, 2, 1.75, 1.5, 1.25, 1, .75, .5, .25], rtol=1e-6)
  cosine = [1 + math.cos(math.pi * k / 8) for k in range(8)]
  np.testing.assert_allclose(_rates("cosine", 10, warmup_steps=2), [0, 1] + cosine,
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(_rates("constant", 5, warmup_steps=4), [0, .5, 1, 1.5, 2])
  # No warmup: the decay starts at the first step; a ratio of 0.15 of 10 rounds up to 2.
  np.testing.assert_allclose(_rates("linear", 4), [2, 1.5, 1, .5])
  np.testing.assert_allclose(_rates("linear", 10, warmup_ratio=0.15),
                             _rates("linear", 10, warmup_steps=2))


@pytest.mark.parametrize("schedule", optim.SCHEDULES)
@pytest.mark.parametrize("steps,warmup", [(12, 3), (7, 0), (9, 9)])
def test_equals_transformers_get_scheduler(schedule, steps, warmup):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
  sched = transformers.get_scheduler(HF_NAMES[schedule], opt, num_warmup_steps=warmup,
                                     num_training_steps=steps)
  want = []
  for _ in range(steps):  # the rate each optimizer step uses, then the scheduler's step
    want.append(sched.get_last_lr()[0])
    opt.step()
    sched.step()
  np.testing.assert_allclose(_rates(schedule, steps, warmup_steps=warmup), want,
                             rtol=1e-6, atol=1e-7)


def test_bad_schedule_flags_are_one_line(tmp_path):
  base = dict(output_dir=str(tmp_path), train_data=__file__)
  for kw, words in [(dict(lr_schedule="step"), "--lr_schedule='step'"),
                    (dict(warmup_ratio=1.0), "--warmup_ratio must be in [0, 1)"),
                    (dict(warmup_steps=2, warmup_ratio=0.1), "not both")]:
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.TrainConfig(**base, **kw).validate(1)
    assert words in str(e.value) and "\n" not in str(e.value)
