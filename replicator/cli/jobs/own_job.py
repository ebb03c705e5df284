"""Your own job: ``model.kind: "module:function"``, a function of yours that builds the step,
the state and the data, trained by ``replicator train`` as the built-in kinds are."""

from __future__ import annotations

import importlib
import inspect
import os
import sys


def own_model(kind: str):
    """The job function that ``model.kind: "module:function"`` names, imported from the working
    directory or the Python path.

    ``function(config, repl, tx)`` receives the `TrainConfig`, the `rp.Replicator` built from
    ``mesh`` and the optax transformation of the ``optimizer`` keys (to wrap with
    ``repl.wrap_optimizer``; its weight-decay mask is decided by `optimizers.decay_mask` on the
    parameters it is given; the peak rate is ``config.optimizer.learning_rate``), and returns
    ``(step_fn, state, input_fn, tokens_per_step)`` as the built-in jobs do (``tokens_per_step``
    may be None); ``rp.fit`` then trains it with the config's steps, checkpoints and logs.

    Raises:
      ValueError: if the module cannot be imported or has no such function.
    """
    module_name, _, name = kind.partition(":")
    if os.getcwd() not in sys.path:  # the `replicator` script's path starts at its own directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model.kind={kind!r}: cannot import {module_name} ({type(e).__name__}: {e}); run "
            f"from the directory that holds it, or add it to PYTHONPATH."
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"model.kind={kind!r}: {module_name} has no function {name}.")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:  # the wrong function: say so, rather than its TypeError when called
        raise ValueError(
            f"model.kind={kind!r}: {name} must take (config, repl, tx), and its signature is "
            f"{inspect.signature(fn)}; name your job function (see jobs.own_model)."
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass

    def job(config, repl, tx):
        out = fn(config, repl, tx)
        if not isinstance(out, tuple) or len(out) != 4:
            raise ValueError(
                f"model.kind={kind!r}: {name}(config, repl, tx) must return (step_fn, state, "
                f"input_fn, tokens_per_step); got {type(out).__name__}."
            )
        return out

    return job
