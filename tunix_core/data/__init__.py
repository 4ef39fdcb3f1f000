"""Preference data: JSONL pairs read and encoded as TRL does (`data.dataset`,
`data.encode`), tokenized once into a token store read per batch (`data.build`,
`data.store`), and the model rows a pair batch is computed in (`data.packing`)."""

from tunix_core.data.build import build as build_store
from tunix_core.data.build import store_key
from tunix_core.data.dataset import BatchIterator
from tunix_core.data.dataset import ByteTokenizer
from tunix_core.data.dataset import check_vocab
from tunix_core.data.dataset import data_change
from tunix_core.data.dataset import DataError
from tunix_core.data.dataset import encode_row
from tunix_core.data.dataset import FIELDS
from tunix_core.data.dataset import IGNORE_INDEX
from tunix_core.data.dataset import load_dataset
from tunix_core.data.dataset import PreferenceDataset
from tunix_core.data.dataset import read_jsonl
from tunix_core.data.dataset import take_pairs
from tunix_core.data.dataset import Tokenizer
from tunix_core.data.dataset import with_chat_template
from tunix_core.data.store import PairStore
