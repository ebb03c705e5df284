"""Run configs: YAML files validated into typed dataclasses, with ``key=value`` overrides.

Only the CLI and the examples read configs; the library takes explicit arguments. A config names
every field it sets; an unknown or mistyped key is an error that names it and lists the valid
ones. Every value is checked here, when the config is built, before any JAX work: a value out of
range, or one the model kind cannot use, is a ``ValueError`` naming the key.

- `sections`: the ``model:``, ``pipeline:``, ``profile:`` and ``wandb:`` sections (``data:`` is
  `replicator.cli.data`'s, ``optimizer:`` `replicator.cli.optimizers`'), each checked alone;
- `train`: `TrainConfig`, the whole config, with `train_checks` (the sections checked together);
- `short_forms`: a file's short forms turned into their long forms, as plain data, before any
  dataclass is built (with `checkpoint`: the ``model:`` of an ``init_from`` checkpoint);
- `loader`: `load` (a YAML file with ``key=value`` overrides) and `from_dict` (plain data, its
  short forms taken, to the frozen dataclasses, which only check it);
- `constants`: the values the keys may take.

>>> TrainConfig(model=ModelConfig(kind="cnn"), zero_stage=3)
Traceback (most recent call last):
...
ValueError: TrainConfig: model.kind='cnn' supports zero_stage 0, 1 or 2 and accumulate_steps=1 (its BatchNorm takes statistics over the whole batch); got zero_stage=3, accumulate_steps=1.
"""

from replicator.cli.config.checkpoint import CHECKPOINT_SIZES as CHECKPOINT_SIZES
from replicator.cli.config.constants import ATTENTIONS as ATTENTIONS
from replicator.cli.config.constants import BYTE_VOCAB as BYTE_VOCAB
from replicator.cli.config.constants import DATA_AXES as DATA_AXES
from replicator.cli.config.constants import DTYPES as DTYPES
from replicator.cli.config.constants import EXPERT_FAMILIES as EXPERT_FAMILIES
from replicator.cli.config.constants import GPT_ONLY as GPT_ONLY
from replicator.cli.config.constants import LLAMA_BLOCK_ONLY as LLAMA_BLOCK_ONLY
from replicator.cli.config.constants import MAX_CPU_DEVICES as MAX_CPU_DEVICES
from replicator.cli.config.constants import MAX_STEPS as MAX_STEPS
from replicator.cli.config.constants import MODEL_FAMILIES as MODEL_FAMILIES
from replicator.cli.config.constants import MODEL_KINDS as MODEL_KINDS
from replicator.cli.config.constants import OWN_KIND as OWN_KIND
from replicator.cli.config.constants import REMAT_POLICIES as REMAT_POLICIES
from replicator.cli.config.constants import RING_IN_ONE_COND as RING_IN_ONE_COND
from replicator.cli.config.constants import SCHEDULES as SCHEDULES
from replicator.cli.config.constants import WANDB_MODES as WANDB_MODES
from replicator.cli.config.loader import from_dict as from_dict
from replicator.cli.config.loader import load as load
from replicator.cli.config.sections import ModelConfig as ModelConfig
from replicator.cli.config.sections import PipelineConfig as PipelineConfig
from replicator.cli.config.sections import ProfileConfig as ProfileConfig
from replicator.cli.config.sections import WandbConfig as WandbConfig
from replicator.cli.config.train import TrainConfig as TrainConfig
from replicator.cli.data import DataConfig as DataConfig
from replicator.cli.optimizers import OptimizerConfig as OptimizerConfig
from replicator.cli.yaml_files import DuplicateKeyError as DuplicateKeyError
from replicator.cli.yaml_files import UniqueKeyLoader as UniqueKeyLoader
