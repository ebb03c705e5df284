"""`rp.fit`'s keyword arguments of the previous release (``checkpoint_dir=``, ``log_every=``,
``eval_fn=``, ...), each now a field of an option record: `translate` turns them into the
records, with a ``DeprecationWarning`` per keyword naming its new spelling, and the same checks
and messages as before. They are served for one release.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

from replicator._src.core import errors
from replicator._src.training.options import CheckpointOptions, EvalOptions, LoggingOptions
from replicator._src.training.profiling import Profile
from replicator._src.training.writers import check_writers

RECORDS = {  # fit's keyword -> its record's class
    "checkpointing": CheckpointOptions,
    "logging": LoggingOptions,
    "evaluation": EvalOptions,
}
OLD = {  # the old keyword -> (fit's keyword, the record's field)
    "checkpoint_dir": ("checkpointing", "directory"),
    "checkpoint_every": ("checkpointing", "every"),
    "keep": ("checkpointing", "keep"),
    "async_checkpoints": ("checkpointing", "async_save"),
    "emergency_after": ("checkpointing", "emergency_after"),
    "start_over_if_unreadable": ("checkpointing", "start_over_if_unreadable"),
    "log_every": ("logging", "every"),
    "metrics_path": ("logging", "metrics_path"),
    "tensorboard_dir": ("logging", "tensorboard_dir"),
    "writers": ("logging", "writers"),
    "examples_per_step": ("logging", "examples_per_step"),
    "tokens_per_step": ("logging", "tokens_per_step"),
    "progress": ("logging", "progress"),
    "profile": ("logging", "profile"),
    "eval_fn": ("evaluation", "fn"),
    "eval_every": ("evaluation", "every"),
}
NEW = ("steps", *RECORDS, "on_step")  # fit's keywords


def new_spelling(old: str) -> str:
    """``checkpointing=rp.training.CheckpointOptions(directory=...)`` for ``checkpoint_dir``."""
    keyword, field = OLD[old]
    return f"{keyword}=rp.training.{RECORDS[keyword].__name__}({field}=...)"


def translate(old: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The option records of ``old`` (old keyword -> value), one warning per keyword.

    Args:
      old: the old keyword arguments fit was given.
      given: fit's own ``checkpointing``, ``logging`` and ``evaluation`` arguments.

    Returns:
      ``given`` with the records that ``old`` describes in place of the Nones.

    Raises:
      TypeError: naming a keyword that is neither fit's nor an old one.
      ValueError: if an old keyword and its record are both given; and for the values the
        old keywords refused, with the same messages.
    """
    for name in old:
        if name not in OLD:
            close = difflib.get_close_matches(name, [*NEW, *OLD], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise TypeError(f"rp.fit() got an unexpected keyword argument {name!r}{hint}")
    for name in old:
        keyword = OLD[name][0]
        if given[keyword] is not None:
            raise ValueError(
                f"rp.fit: {name}= (deprecated) and {keyword}= are both given; give "
                f"{name} in the record alone: {new_spelling(name)}."
            )
        warnings.warn(
            f"rp.fit: {name}= is deprecated and will be removed in the next release; use "
            f"{new_spelling(name)}.",
            DeprecationWarning,
            stacklevel=3,  # the caller of fit
        )
    writers = check_writers(old.get("writers", ()), api="rp.fit")
    try:
        return given | _records(old, writers)
    except BaseException:
        _close(writers)  # as fit closed them when it refused its arguments
        raise


def _records(old: dict[str, Any], writers: list) -> dict[str, Any]:
    """The records of ``old``, checked as fit checked its keywords."""
    get = old.get
    directory = get("checkpoint_dir")
    for name in ("checkpoint_every", "eval_every", "log_every"):
        errors.positive_int(get(name), api="rp.fit", name=name, none=" or None")
    if get("checkpoint_every") and directory is None:
        raise ValueError(
            "rp.fit: checkpoint_every is set but checkpoint_dir is None; give checkpoint_dir "
            "(a directory) to save checkpoints."
        )
    errors.positive_int(get("emergency_after", 1), api="rp.fit", name="emergency_after",
                        none=" or None")  # fmt: skip
    for name in ("async_checkpoints", "start_over_if_unreadable"):
        if not isinstance(get(name, False), bool):
            raise TypeError(f"rp.fit: {name} must be True or False; got {get(name)!r}.")
    records: dict[str, Any] = {}
    fields = {
        OLD[name][1]: value
        for name, value in old.items()
        if OLD[name][0] == "checkpointing" and name != "checkpoint_dir"
    }
    if directory is not None:  # without a directory the other checkpoint keywords did nothing
        errors.positive_int(get("keep", 3), api="rp.Checkpoints", name="keep")
        records["checkpointing"] = CheckpointOptions(directory, **fields)
    logging = {OLD[name][1]: value for name, value in old.items() if OLD[name][0] == "logging"}
    if logging:
        logging |= {"writers": writers, "progress": bool(get("progress", True))}
        logging["profile"] = Profile.of(get("profile"))
        for name in ("examples_per_step", "tokens_per_step"):
            logging[name] = logging.get(name) or None  # 0 or None: no figure
        records["logging"] = LoggingOptions(**logging)
    if get("eval_fn") is not None and get("eval_every"):  # else it never evaluated
        records["evaluation"] = EvalOptions(get("eval_fn"), get("eval_every"))
    return records


def _close(writers: list) -> None:
    """Closes every writer; a writer whose ``close`` raises is a warning (the refusal being
    raised stays the error)."""
    for writer in writers:
        try:
            writer.close()
        except Exception as e:
            warnings.warn(f"rp.fit: closing writer {writer!r} failed: {e!r}", stacklevel=4)
