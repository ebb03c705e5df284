"""Bad input to ``replicator train``, ``explain``, ``plan`` and ``launch``, as a user types it:
each is refused in one line on stderr that names the key, file or flag and the fix, with exit
code 2, no traceback, and nothing created or changed on disk; or it does the right thing and
says so (an empty ``init_from`` is no ``init_from``; a resumed run started from another
``init_from`` says its checkpoint wins). Advice is never circular: following it works, or
gives a different answer.

In process (``cli.main([...])``) where possible; what starts processes is slow.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import re
import sys
import time

import jax
import numpy as np
import pytest

from replicator import cli
from replicator.cli import config, runs
from replicator.models import hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
LLAMA_TINY = CONFIGS / "llama_tiny.yaml"
TINY_LLAMA = {  # a checkpoint llama_tiny.yaml's mesh ({data: 4, model: 2}) can hold
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
}
SMALL_RUN = ["model.seq_len=16", "global_batch=8", "plot=false"]
PLAIN_MESH = ["mesh={data: -1}", "zero_stage=0"]  # quick to compile


def snapshot(root: pathlib.Path) -> dict[str, str | None]:
    """Every path under ``root``: a file's content hash, None for a directory."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = None if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    """``replicator ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own exit
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, command: str, *words: str) -> None:
    """Exit code 2 and one line on stderr, ``replicator COMMAND: ...``, holding ``words``."""
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.startswith(f"replicator {command}: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line
    for word in words:
        assert word in err, (word, err)


def refused_untouched(capsys, tmp_path, command: str, argv, *words: str) -> str:
    """Runs ``argv``, asserts the one-line refusal and that ``tmp_path`` is as it was."""
    before = snapshot(tmp_path)
    code, out, err = run(capsys, command, *argv)
    assert_refused(code, err, command, *words)
    assert snapshot(tmp_path) == before, "a refused command changed the disk"
    assert "Traceback" not in out
    return err


def write_checkpoint(directory: pathlib.Path, seed: int) -> pathlib.Path:
    """A Llama checkpoint of `TINY_LLAMA`'s sizes (random weights from ``seed``)."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32), hf.shapes(TINY_LLAMA)
    )
    return hf.save(directory, params, TINY_LLAMA)


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A word-level tokenizer.json of ``vocab_size`` ids: <unk>, </s> (its EOS), w0, w1, ..."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i + 2 for i in range(vocab_size - 2)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def write_text(path: pathlib.Path, words: int = 3000) -> pathlib.Path:
    path.write_text(" ".join(f"w{i % 150}" for i in range(words)))
    return path


# -- section 2: accepted silently ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["init_from=", "init_from=null", "init_from=''", "init_from=~"])
def test_an_empty_init_from_is_the_same_as_none(value):
    """The config's model sizes stay, as without the key (not the defaults' sizes)."""
    plain = config.load(LLAMA_TINY)
    empty = config.load(LLAMA_TINY, [value])
    assert empty == plain and empty.init_from is None
    assert (empty.model.d_model, empty.model.kv_heads, empty.model.d_ff) == (64, 2, 176)


def test_an_empty_init_from_in_the_file_is_the_same_as_none(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(LLAMA_TINY.read_text() + 'init_from: ""\n')
    assert config.load(path) == config.load(LLAMA_TINY)


@pytest.mark.slow  # two short runs (about 15 s)
def test_a_resume_with_another_init_from_says_the_checkpoint_wins(capsys, tmp_path):
    first, second = write_checkpoint(tmp_path / "a", 0), write_checkpoint(tmp_path / "b", 1)
    args = [*SMALL_RUN, f"out_dir={tmp_path / 'runs'}", "checkpoint_every=1", "log_every=1"]
    code, _, err = run(capsys, "train", LLAMA_TINY, f"init_from={first}", "steps=1", *args)
    assert code == 0, err
    assert "wins" not in err
    code, _, err = run(capsys, "train", LLAMA_TINY, f"init_from={second}", "steps=2", *args)
    assert code == 0, err
    (line,) = [x for x in err.splitlines() if "wins" in x]
    assert f"init_from='{first}'" in line and f"init_from='{second}' is not read" in line, line
    assert "checkpoint of step 1" in line and "another name=" in line, line
    code, _, err = run(capsys, "train", LLAMA_TINY, f"init_from={first}", "steps=3", *args)
    assert code == 0 and "wins" not in err, err  # the one it started with: nothing to say


@pytest.mark.parametrize(
    "n, minimum, valid",
    [(4, 3, "give --min-processes 2, 1 or 4"), (6, 4, "give --min-processes 3, 2, 1 or 6")],
)
def test_min_processes_that_can_never_act_is_refused(capsys, tmp_path, n, minimum, valid):
    argv = ["-n", n, "--min-processes", minimum, "--max-restarts", 1, "--", "true"]
    refused_untouched(
        capsys, tmp_path, "launch", argv, f"--min-processes {minimum} can never act", valid
    )


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.rope_theta=-1", ["model.rope_theta", "> 0", "rope_theta=10000.0"]),
        ("model.rope_theta=0", ["model.rope_theta", "> 0"]),
        ("model.rope_theta=.inf", ["model.rope_theta", "finite"]),
        ("model.norm_eps=-1", ["model.norm_eps", "> 0", "norm_eps=1e-5"]),
        ("model.norm_eps=0", ["model.norm_eps", "> 0"]),
        ("model.norm_eps=.nan", ["model.norm_eps", "finite"]),
        ("cpu_devices=100000", ["cpu_devices", "4096"]),
        ("steps=99999999999999", ["steps", "2147483647"]),
        ("mesh={}", ["mesh", "at least one axis", "data: -1"]),
        ("profile.start_step=500", ["profile.start_step", "steps=200"]),
    ],
)
def test_numbers_the_model_cannot_use_are_refused_at_load(capsys, tmp_path, override, words):
    argv = [LLAMA_TINY, f"out_dir={tmp_path}", override]
    refused_untouched(capsys, tmp_path, "train", argv, *words)


# -- section 3: the tokenizer's advice is not circular ------------------------------------------


def test_a_tokenizer_larger_than_the_checkpoints_vocabulary_gets_advice_that_works(
    capsys, tmp_path
):
    ckpt = write_checkpoint(tmp_path / "ckpt", 0)
    own = write_tokenizer(ckpt / "tokenizer.json", 200)  # the checkpoint's own: 200 <= 256
    big = write_tokenizer(tmp_path / "big.json", 300)
    text = write_text(tmp_path / "text.txt")
    base = [LLAMA_TINY, f"init_from={ckpt}", f"data.path={text}", *SMALL_RUN]
    base.append(f"out_dir={tmp_path / 'runs'}")
    err = refused_untouched(
        capsys, tmp_path, "train", [*base, f"data.tokenizer={big}"],
        "300 token ids", "init_from", f"data.tokenizer={own}",
    )  # fmt: skip
    assert "set model.vocab" not in err, err
    # what the circle was: model.vocab=300 is refused, with advice that leads back here
    err = refused_untouched(
        capsys, tmp_path, "train", [*base, f"data.tokenizer={big}", "model.vocab=300"],
        "remove model.vocab",
    )  # fmt: skip
    # the advice followed: it works (test_following_the_tokenizer_advice_works)


def test_without_init_from_the_advice_is_a_larger_vocabulary_and_it_works(capsys, tmp_path):
    big = write_tokenizer(tmp_path / "big.json", 300)
    text = write_text(tmp_path / "text.txt")
    base = [LLAMA_TINY, f"data.path={text}", f"data.tokenizer={big}", *SMALL_RUN]
    base.append(f"out_dir={tmp_path / 'runs'}")
    refused_untouched(capsys, tmp_path, "train", base, "set model.vocab=300")


@pytest.mark.slow  # compiles two steps (about 15 s)
def test_following_the_tokenizer_advice_works(capsys, tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", 0)
    own = write_tokenizer(ckpt / "tokenizer.json", 200)
    big = write_tokenizer(tmp_path / "big.json", 300)
    text = write_text(tmp_path / "text.txt")
    base = [LLAMA_TINY, f"data.path={text}", *SMALL_RUN, *PLAIN_MESH]
    code, out, err = run(capsys, "explain", *base, f"init_from={ckpt}", f"data.tokenizer={own}")
    assert code == 0, err
    assert "llama_tiny (llama)" in out  # the family the checkpoint gives
    code, _, err = run(capsys, "explain", *base, f"data.tokenizer={big}", "model.vocab=300")
    assert code == 0, err


def test_a_checkpoint_without_a_tokenizer_names_what_one_must_be(capsys, tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", 0)
    big = write_tokenizer(tmp_path / "big.json", 300)
    text = write_text(tmp_path / "text.txt")
    argv = [LLAMA_TINY, f"init_from={ckpt}", f"data.path={text}", f"data.tokenizer={big}",
            *SMALL_RUN, f"out_dir={tmp_path / 'runs'}"]  # fmt: skip
    refused_untouched(capsys, tmp_path, "train", argv, "at most its vocab_size ids", "256")


# -- section 3: plan's flags -------------------------------------------------------------------

PLAN = ["plan", CONFIGS / "lm_dp.yaml", "--devices", 8, "--hardware", "tpu-v5e"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-model", 0], ["--max-model must be 1 or more", "no tensor parallelism"]),
        (["--max-stage", 0], ["--max-stage must be 1 or more"]),
        (["--max-context", -1], ["--max-context must be 1 or more"]),
        (["--max-expert", 0], ["--max-expert must be 1 or more"]),
        (["--min-context-seq", -1], ["--min-context-seq must be 1 or more"]),
        (["--top", 0], ["--top must be 1 or more"]),
        (["--memory", "-5GiB"], ["--memory -5GiB", "1 byte or more", "--memory 16GiB"]),
        (["--memory=-5GiB"], ["--memory -5GiB", "1 byte or more"]),
        (["--memory", "0"], ["--memory 0", "1 byte or more"]),
        (["--memory", "lots"], ["--memory lots", "is not a size", "16GiB"]),
        (["--overlap", 2], ["--overlap must be a share from 0 to 1"]),
        (["--schedules", "zigzag"], ["--schedules 'zigzag'", "1f1b"]),
        (["--zero-stages", 7], ["--zero-stages='7'", "0, 1, 2 or 3"]),
        (["--devices", 100000], ["--devices 100000", "at most 4096"]),
        (["--devices", "two"], ["argument --devices: invalid int value: 'two'", "--help"]),
        (["--devices", 3], ["no layout of 3 devices", "global_batch=32", "--devices 2 or 4"]),
    ],
)
def test_plan_flags_out_of_range_are_one_line_naming_the_flag(capsys, tmp_path, flags, words):
    argv = [*PLAN[1:], *flags, f"out_dir={tmp_path}"]
    refused_untouched(capsys, tmp_path, "plan", argv, *words)


def test_plan_refuses_a_budget_the_state_alone_cannot_fit_before_compiling(capsys, tmp_path):
    t0 = time.perf_counter()
    argv = [*PLAN[1:], "--memory", "1KiB", f"out_dir={tmp_path}"]
    err = refused_untouched(capsys, tmp_path, "plan", argv, "--memory 1.00 KiB", "state alone")
    assert time.perf_counter() - t0 < 30  # nothing compiled (it took 86 s)
    least = re.search(r"give --memory more than ([\d.]+ KiB)", err)
    assert least, err
    assert "MiB" in err.split("alone:")[1]  # the state's size, then the least per device


def test_plan_reads_overrides_after_its_flags(capsys, tmp_path):
    """``plan CONFIG --devices 8 key=value`` (argparse alone: "unrecognized arguments")."""
    argv = [*PLAN[1:], "--max-model", 0, "model.layers=2", f"out_dir={tmp_path}"]
    refused_untouched(capsys, tmp_path, "plan", argv, "--max-model")


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_plan_output_paths_that_cannot_be_written_are_refused_first(capsys, tmp_path, flag):
    refused_untouched(capsys, tmp_path, "plan", [*PLAN[1:], flag, tmp_path], "is a directory")
    missing = tmp_path / "no" / "plan.yaml"
    refused_untouched(capsys, tmp_path, "plan", [*PLAN[1:], flag, missing], "not a directory")


def test_explain_json_that_cannot_be_written_is_refused_first(capsys, tmp_path):
    argv = [CONFIGS / "mlp_zero.yaml", "--json", tmp_path / "no" / "r.json"]
    refused_untouched(capsys, tmp_path, "explain", argv, "--json", "not a directory")


# -- section 3: a refused run leaves nothing on disk ---------------------------------------------

REFUSED_RUNS = {
    "missing tokenizer": (
        "lm_dp", ["data.path={text}", "data.tokenizer={tmp}/nope.json"], ["data.tokenizer"]
    ),
    "interleaved schedule that cannot run": (
        "lm_pipeline",
        ["pipeline.schedule=interleaved", "pipeline.microbatches=3"],
        ["pipeline.microbatches=3", "mesh.stage=4"],
    ),
    "mesh that does not fit": ("mlp_zero", ["mesh.data=16"], ["16 devices", "cpu_devices"]),
    "mesh that does not fit, in new parents": (
        "mlp_zero", ["mesh.data=16", "out_dir={tmp}/a/b"], ["16 devices"]
    ),
    "global_batch over the replicas": (
        "mlp_zero", ["global_batch=30"], ["global_batch=30", "8 replicas", "global_batch=32"]
    ),
    "global_batch over the micro-batches": (
        "mlp_zero", ["accumulate_steps=3"], ["accumulate_steps=3", "global_batch=264"]
    ),
    "pipeline micro-batches": (
        "lm_pipeline", ["pipeline.microbatches=12"], ["pipeline.microbatches=12", "divid"]
    ),
    "a job function of another signature": (
        "mlp_zero", ["model.kind=os:system"], ["model.kind='os:system'", "(config, repl, tx)"]
    ),
    "unreadable npz": (
        "mlp_zero", ["data.path={tmp}/x.npz"], ["data.path", "np.savez(path, x=x, y=y)"]
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_RUNS))
def test_a_refused_run_leaves_no_directory(case, capsys, tmp_path):
    name, overrides, words = REFUSED_RUNS[case]
    text = write_text(tmp_path / "text.txt")
    (tmp_path / "x.npz").write_text("garbage")
    overrides = [o.format(text=text, tmp=tmp_path) for o in overrides]
    argv = [CONFIGS / f"{name}.yaml", f"out_dir={tmp_path}", "steps=2", *overrides]
    refused_untouched(capsys, tmp_path, "train", argv, *words)


def test_a_refusal_inside_fit_removes_the_directory_it_made(capsys, tmp_path, monkeypatch):
    import replicator as rp

    def refusing_fit(repl, step_fn, state, input_fn, *, checkpointing, logging, **kw):
        os.makedirs(checkpointing.directory)  # as rp.fit does before it refuses
        pathlib.Path(logging.metrics_path).write_text("")
        raise ValueError("rp.fit: refused on purpose")

    monkeypatch.setattr(rp, "fit", refusing_fit)
    argv = [CONFIGS / "mlp_zero.yaml", f"out_dir={tmp_path / 'new'}", "steps=2"]
    refused_untouched(capsys, tmp_path, "train", argv, "refused on purpose")


def test_a_refused_resume_keeps_the_run_directory(capsys, tmp_path):
    argv = [CONFIGS / "mlp_zero.yaml", f"out_dir={tmp_path}", "steps=2", "checkpoint_every=2",
            "model.layers=2", "model.d_model=32", "plot=false"]  # fmt: skip
    assert run(capsys, "train", *argv)[0] == 0
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "train", *argv[:-2], "model.d_model=16", "plot=false")
    assert_refused(code, err, "train", "checkpoint step 2")
    assert {k for k in snapshot(tmp_path) if k in before} == set(before)  # nothing removed


# -- the hunt: files, paths and types ------------------------------------------------------------

BAD_FILES = {
    "empty": ("", ["is empty", "name: run1"]),
    "comments only": ("# a config\n", ["is empty"]),
    "a list": ("- steps: 3\n", ["top level must be a mapping", "got a list"]),
    "a number": ("42\n", ["top level must be a mapping", "got an int"]),
    "tabs": ("name: x\n\tsteps: 3\n", ["is not YAML", "replace the tabs with spaces"]),
    "binary": (b"\xff\xfe\x00\x01binary", ["is not YAML"]),
    "truncated": ("name: x\nmodel: {kind: mlp\n", ["is not YAML", "line 3"]),
    "two documents": ("steps: 3\n---\nsteps: 4\n", ["is not YAML", "single document"]),
    "a python tag": ("steps: !!python/object:os.system ls\n", ["is not YAML"]),
    "an unhashable key": ("[1, 2]: 3\n", ["is not YAML", "unhashable key"]),
    "a mesh list": ("mesh: [data, 8]\n", ["mesh: expected dict", "list"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_config_files_are_one_line_naming_the_file(case, capsys, tmp_path):
    text, words = BAD_FILES[case]
    path = tmp_path / "c.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    refused_untouched(capsys, tmp_path, "train", [path, f"out_dir={tmp_path}"], "c.yaml", *words)


def test_a_negative_data_seed_is_refused_before_the_run(capsys, tmp_path):
    path = tmp_path / "x.npz"
    np.savez(path, x=np.zeros((256, 16), np.float32), y=np.zeros((256, 1), np.float32))
    argv = [CONFIGS / "mlp_zero.yaml", f"out_dir={tmp_path}", f"data.path={path}", "data.seed=-1"]
    refused_untouched(capsys, tmp_path, "train", argv, "data.seed=-1", "2**32 - 1")


def test_a_directory_given_as_the_config_is_refused(capsys, tmp_path):
    refused_untouched(capsys, tmp_path, "train", [tmp_path], "is a directory", "YAML file")


BAD_VALUES = {
    "steps in e notation": (["steps=1e3"], ["steps", "'1e3'", "Write it as an integer: 1000"]),
    "a whole float": (["global_batch=32.0"], ["global_batch", "integer: 32"]),
    "a fraction": (["global_batch=3.5"], ["global_batch: expected int", "3.5"]),
    "a list for a number": (["steps=[1, 2]"], ["steps: expected int", "[1, 2]"]),
    "an empty key part": (["model..layers=2"], ["'model..layers'", "empty part"]),
    "a leading dot": ([".steps=3"], ["'.steps'", "empty part"]),
    "a number in a section's place": (["steps.x=3"], ["steps is not a section"]),
    "out_dir empty": (["out_dir="], ["out_dir has no value", "give one (out_dir=VALUE)"]),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_are_one_line_naming_the_key(case, capsys, tmp_path):
    overrides, words = BAD_VALUES[case]
    argv = [CONFIGS / "mlp_zero.yaml", f"out_dir={tmp_path}", *overrides]
    refused_untouched(capsys, tmp_path, "train", argv, *words)


def test_out_dir_or_run_directory_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    cfg = CONFIGS / "mlp_zero.yaml"
    refused_untouched(capsys, tmp_path, "train", [cfg, f"out_dir={tmp_path / 'f'}"],
                      "out_dir=", "is a file")  # fmt: skip
    refused_untouched(capsys, tmp_path, "train", [cfg, f"out_dir={tmp_path / 'f' / 'sub'}"],
                      "out_dir=", "is a file")  # fmt: skip
    refused_untouched(capsys, tmp_path, "train", [cfg, f"out_dir={tmp_path}", "name=f"],
                      "name='f'", "is a file")  # fmt: skip


def test_an_unwritable_out_dir_is_refused(capsys, tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
    argv = [CONFIGS / "mlp_zero.yaml", f"out_dir={tmp_path}"]
    refused_untouched(capsys, tmp_path, "train", argv, "out_dir=", "is not writable")


def test_a_tilde_in_out_dir_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nout_dir: ~/runs\n")
    assert config.load(path).out_dir == str(tmp_path / "runs")


def test_explain_of_a_mesh_too_big_to_emulate_is_refused(capsys, tmp_path):
    argv = [CONFIGS / "lm_dp.yaml", "mesh.data=5000"]
    refused_untouched(capsys, tmp_path, "explain", argv, "5000 devices", "at most 4096")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["-n", 0, "--", "true"], ["-n must be an int >= 1"]),
        (["-n", -1, "--", "true"], ["-n must be an int >= 1"]),
        (["-n", 2, "--devices-per-process", 100000, "--", "true"], ["at most 4096"]),
        (["-n", 2, "--max-restarts", -1, "--", "true"], ["--max-restarts must be an int >= 0"]),
        (["-n", 2], ["give the command to run after --"]),
    ],
)
def test_launch_arguments_out_of_range_start_nothing(capsys, tmp_path, argv, words):
    refused_untouched(capsys, tmp_path, "launch", argv, *words)


def test_the_first_line_names_the_cpu():
    line = runs.machine(jax.devices())
    assert line == f"cpu ({runs.cpu_name()}, 8 emulated devices)", line
    assert runs.cpu_name() and "\n" not in runs.cpu_name()


def test_the_readmes_sample_output_has_the_first_line_the_job_prints():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^replicator train lm_pipeline: Replicator\(.*$", readme, re.MULTILINE)
    assert first, "no sample output in the README"
    assert re.search(r" on cpu \(.+, 8 emulated devices\)$", first[0]), first[0]
    sample = readme[first.start() : readme.index("```", first.start())].strip().splitlines()
    assert len(sample) <= 5, sample  # the front page's sample: the first and last lines
    assert re.fullmatch(
        r"replicator train lm_pipeline: loss \d\.\d{4} -> \d\.\d{4}, 200 steps in [\d.]+ s; "
        r"outputs in runs/lm_pipeline",
        sample[-1],
    ), sample[-1]
    assert "last digits" in readme


# -- the launcher: processes (slow) --------------------------------------------------------------


@pytest.mark.slow
def test_exit_2_before_any_heartbeat_is_not_restarted(capsys, tmp_path):
    marker = tmp_path / "starts"
    script = f"echo x >> {marker}; exit 2"
    code, _, err = run(capsys, "launch", "-n", 1, "--max-restarts", 2, "--", "sh", "-c", script)
    assert code == 2, err
    assert marker.read_text().count("x") == 1  # started once
    (line,) = err.splitlines()
    assert "rank 0 exited with 2" in line and "not restarted" in line, err


@pytest.mark.slow
def test_the_launchers_own_lines_go_to_stderr():
    import subprocess

    cmd = [sys.executable, "-m", "replicator.launch", "-n", "2", "--", "sh", "-c",
           'echo "hello from $REPLICATOR_PROCESS_ID"; [ "$REPLICATOR_PROCESS_ID" = 1 ] && '
           "exit 3; sleep 30"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "replicator launch:" not in result.stdout, result.stdout
    assert "[1] hello from 1" in result.stdout
    assert "replicator launch: rank 1 exited with 3" in result.stderr, result.stderr


@pytest.mark.slow
def test_launch_writes_its_lines_to_err_and_the_output_to_out(tmp_path):
    import replicator as rp

    out, err = io.StringIO(), io.StringIO()
    code = rp.distributed.launch(["sh", "-c", "echo hi; exit 3"], num_processes=1, grace=1,
                                 out=out, err=err)  # fmt: skip
    assert code == 3
    assert out.getvalue() == "[0] hi\n", out.getvalue()
    assert err.getvalue() == "replicator launch: rank 0 exited with 3.\n", err.getvalue()


def test_json_report_is_untouched_by_refusals(capsys, tmp_path):
    """--json of explain is written only when the report exists (a refusal writes nothing)."""
    report = tmp_path / "r.json"
    argv = [CONFIGS / "mlp_zero.yaml", "global_batch=30", "--json", report]
    refused_untouched(capsys, tmp_path, "explain", argv, "global_batch=30")
    assert not report.exists()
