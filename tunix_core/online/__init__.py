"""Online DPO (`--online_samples=K`): each step the policy samples K completions of every
prompt of its batch on the devices under the run's layout (`sampler`), `--reward_fn`
(`reward_fn` imports, checks and calls it as TRL does; `rewards` ships the quickstart's)
and `--reward_model` (`reward_model`: a Hugging Face classifier) score them, and
the best and the worst become the pair the step trains on (`data.sampled_pairs`)."""

from tunix_core.online.reward_fn import load as load_reward
from tunix_core.online.reward_fn import RewardError
from tunix_core.online.reward_model import check as check_reward_model
from tunix_core.online.reward_model import RewardModel
from tunix_core.online.sampler import longest_prompt
from tunix_core.online.sampler import OnlineSampler
