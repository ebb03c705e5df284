"""Your own data for ``replicator train``: local text files, NumPy arrays and ArrayRecord files,
no download.

A ``data:`` section names a path; the job reads it once into examples (ArrayRecord files:
record by record, as batches need them), checks every example against what the model kind
trains on (the shapes and dtypes of a batch of its built-in data), and serves them with
`rp.Batches` (ArrayRecord: `RecordBatches`): each process reads its part of every global batch
(`InputContext`), every epoch in a new order, and the position is checkpointed, so a resumed
run goes on with the next batch.

- ``gpt``: a text file, or a directory of them (every file whose suffix is in ``extensions``,
  in sorted order), read as bytes: token ids 0-255, the byte-level vocabulary. With
  ``tokenizer`` (a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``), each file is
  one document, encoded by the tokenizer, its end-of-document token (EOS) appended; the
  documents are packed one after another into one stream (`encode`). Or a ``.npy``
  of token ids: 1-D (one stream) or 2-D ``[N, seq_len + 1]`` (windows). A stream is cut into
  ``N = (len - 1) // seq_len`` windows of ``seq_len + 1`` tokens, one after another; each
  example is ``tokens = window[:-1]``, ``targets = window[1:]``.
- ``mlp`` and ``cnn``: a ``.npz`` with arrays ``x`` and ``y``, one row per example, of the
  shapes and dtypes of the kind's built-in batches (``mlp``: ``x [N, 16]`` float, ``y [N, 1]``
  float; ``cnn``: ``x [N, 16, 16, 1]`` float, ``y [N]`` integer labels).
- ArrayRecord files (``format: arrayrecord``, or a name ending in ``.array_record``, with or
  without a shard suffix such as ``-00000-of-00008``): a file, a directory of such files, or a
  glob of shards. They are not read into memory: grain reads each batch's records by index
  (`Records`, `RecordBatches`). Each record is one example, as the bytes ``np.save`` writes:
  for ``gpt`` a 1-D integer array of ``seq_len + 1`` token ids (the window), for ``mlp`` and
  ``cnn`` the bytes ``np.savez`` writes of one example's ``x`` and ``y``. Every record is
  checked as it is read.

The modules: `section` (`DataConfig`, the ``data:`` section), `loading` (`examples`, `check`,
`input_fn`), `files` (local text and NumPy files), `tokenizer` (`Tokenizer`, `encode`) and
`records` (`Records`, `RecordBatches`: ArrayRecord files).
"""

from replicator.cli.data.files import windows as windows
from replicator.cli.data.loading import check as check
from replicator.cli.data.loading import examples as examples
from replicator.cli.data.loading import input_fn as input_fn
from replicator.cli.data.records import ARRAY_RECORD_NAME as ARRAY_RECORD_NAME
from replicator.cli.data.records import RecordBatches as RecordBatches
from replicator.cli.data.records import Records as Records
from replicator.cli.data.section import FORMATS as FORMATS
from replicator.cli.data.section import TOKENIZER_SUFFIXES as TOKENIZER_SUFFIXES
from replicator.cli.data.section import DataConfig as DataConfig
from replicator.cli.data.tokenizer import EOS_NAMES as EOS_NAMES
from replicator.cli.data.tokenizer import Tokenized as Tokenized
from replicator.cli.data.tokenizer import Tokenizer as Tokenizer
from replicator.cli.data.tokenizer import encode as encode
