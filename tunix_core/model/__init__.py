"""The model: `ModelConfig` (every family's options, presets) and the decoder as pure
functions over a params pytree (`tunix_core.model.decoder`)."""

from tunix_core.model.config import DTYPES
from tunix_core.model.config import LAYER_TYPES
from tunix_core.model.config import MLP_ACTIVATIONS
from tunix_core.model.config import ModelConfig
from tunix_core.model.config import preset
from tunix_core.model.config import PRESETS
from tunix_core.model.config import REMAT_POLICIES
from tunix_core.model.config import RematPolicy
from tunix_core.model.config import ROPE_TYPES
from tunix_core.model.decoder import self_attention
from tunix_core.model.decoder import decoder
from tunix_core.model.decoder import default_positions
from tunix_core.model.decoder import embed
from tunix_core.model.decoder import forward
from tunix_core.model.decoder import init_params
from tunix_core.model.decoder import lm_head
from tunix_core.model.decoder import logits
from tunix_core.model.decoder import mlp
from tunix_core.model.decoder import param_specs
from tunix_core.model.decoder import rms_norm
from tunix_core.model.decoder import softcap
from tunix_core.model.rope import apply_rope
from tunix_core.model.rope import layer_settings
from tunix_core.model.rope import rope_frequencies
