"""The jobs behind ``replicator train CONFIG``: a config becomes a model, an input_fn, a step_fn
and a `rp.fit` run, with metrics, checkpoints and pictures in ``out_dir/name``; or, for planning,
the same step_fn with its state and batch as shapes (`abstract_job`), allocating nothing.

Built on the public API only (``replicator``, ``replicator.models``). The config is checked
before it gets here (`replicator.cli.config`); what is refused here is what only the library can
see: the mesh against the devices, the batch against the replicas, the run directory, the
checkpoint.

The modules, one a command: `training` (`run`: the processes joined, `rp.fit`, and what is
refused before the first step, first of all by `memory`: the state, from shapes, against
this machine's memory), `explaining` (`explain`), on `processes` (the processes joined,
`elastic`: the config on fewer of them), `devices` (the emulated CPU devices) and `refusals`
(`SetupError`); `building` (`build`, `abstract_job`: the job of a config's model kind), one
module a job (`gpt_job`, `mlp_job`, `cnn_job`, and `own_job` for your own ``module:function``)
on what they share (`base`), and `pictures` (the loss plot, the schedule). The names below are
re-exports: a patch of one here reaches no caller; patch the module that looks it up (`run`
and `explain` build through ``building.checked_build``, which calls ``building.build``).
"""

from replicator.cli.jobs.building import abstract_job as abstract_job
from replicator.cli.jobs.building import build as build
from replicator.cli.jobs.building import check_batch as check_batch
from replicator.cli.jobs.explaining import check_writable as check_writable
from replicator.cli.jobs.explaining import explain as explain
from replicator.cli.jobs.gpt_job import gpt_config as gpt_config
from replicator.cli.jobs.gpt_job import model_flops as model_flops
from replicator.cli.jobs.own_job import own_model as own_model
from replicator.cli.jobs.processes import elastic as elastic
from replicator.cli.jobs.refusals import RUN_ERRORS as RUN_ERRORS
from replicator.cli.jobs.refusals import USER_ERRORS as USER_ERRORS
from replicator.cli.jobs.refusals import SetupError as SetupError
from replicator.cli.jobs.training import run as run
