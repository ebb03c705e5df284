"""Faults of `replicator launch`: each ends in a known state, fast, with the right rank blamed.

Every job runs 2 processes x 1 emulated device of tests/multiprocess/worker_fault.py. Times are
measured from the moment of failure (the worker writes it to ``failed_at`` just before failing).
"""

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import replicator as rp

WORKER = Path(__file__).resolve().parents[1] / "multiprocess" / "worker_fault.py"
LAUNCH = [sys.executable, "-m", "replicator.launch"]

pytestmark = pytest.mark.slow  # every test here starts processes


def launch_fault(tmp_path, mode, *, failing=1, extra=(), timeout=60):
    """Runs a 2-process job that fails as ``mode`` says; returns (code, output, seconds after
    the failure at which the launcher exited)."""
    cmd = [*LAUNCH, "-n", "2", "--devices-per-process", "1", *extra, "--"]
    cmd += [sys.executable, str(WORKER), mode, str(failing), str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    ended = time.time()
    failed_at = float((tmp_path / "failed_at").read_text())
    return run.returncode, run.stdout + run.stderr, ended - failed_at


def assert_gone(tmp_path):
    for rank in (0, 1):
        pid = int((tmp_path / f"rank{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_exception_in_a_rank_ends_the_job_fast_with_its_code_and_rank(tmp_path):
    code, out, after = launch_fault(tmp_path, "raise")
    assert code == 1, out[-3000:]
    assert "rank 1 exited with 1" in out and "rank 0 " not in out.splitlines()[-1], out[-3000:]
    assert "RuntimeError: rank 1 fails on purpose" in out
    assert after < 5, f"the job ended {after:.1f} s after the failure"
    assert_gone(tmp_path)


def test_sys_exit_3_is_the_launchers_exit_code(tmp_path):
    code, out, after = launch_fault(tmp_path, "exit3")
    assert code == 3, out[-3000:]
    assert "replicator launch: rank 1 exited with 3" in out, out[-3000:]
    assert after < 5, f"the job ended {after:.1f} s after the failure"


def test_a_failure_of_rank_0_names_rank_0(tmp_path):
    code, out, after = launch_fault(tmp_path, "exit3", failing=0)
    assert code == 3 and "replicator launch: rank 0 exited with 3" in out, out[-3000:]
    assert after < 5, f"the job ended {after:.1f} s after the failure"


def test_a_killed_rank_gives_128_plus_9_and_is_named(tmp_path):
    code, out, after = launch_fault(tmp_path, "kill")
    assert code == 128 + 9, out[-3000:]
    assert "replicator launch: rank 1 was killed by SIGKILL" in out, out[-3000:]
    assert after < 5, f"the job ended {after:.1f} s after the failure"
    assert_gone(tmp_path)


@pytest.mark.slow
def test_raise_system_exit_3_ends_the_job_as_fast_as_sys_exit(tmp_path):
    """A bare ``raise SystemExit(3)`` reaches no handler that could see its code; the launcher's
    workers record it when the exception is made, and leave without JAX's shutdown barrier (which
    held the job 31 s and blamed rank 0's abort)."""
    code, out, after = launch_fault(tmp_path, "raise_exit3")
    assert code == 3, out[-3000:]
    assert "replicator launch: rank 1 exited with 3" in out, out[-3000:]
    assert after < 5, f"the job ended {after:.1f} s after the failure"


@pytest.mark.slow
def test_a_rank_stuck_inside_a_step_is_named_with_the_ranks_it_cannot_be_told_from(tmp_path):
    """Every rank made the same reports: the one that holds the others cannot be told from those
    that wait for it, and the launcher says so instead of blaming one of them alone."""
    code, out, after = launch_fault(tmp_path, "stuck_in_step", extra=["--watchdog", "3"])
    assert code == 124, out[-3000:]
    assert "replicator launch: ranks [0, 1] (each stopped in the same step" in out, out[-3000:]
    assert after < 3 + 5, f"the job ended {after:.1f} s after the failure"
    assert_gone(tmp_path)


@pytest.mark.slow
def test_a_stuck_rank_is_ended_by_the_watchdog_and_named(tmp_path):
    code, out, after = launch_fault(tmp_path, "stuck", extra=["--watchdog", "3"])
    assert code == 124, out[-3000:]
    assert "replicator launch: rank 1 made no progress for more than 3 s" in out, out[-3000:]
    assert "--watchdog 3" in out
    assert after < 3 + 5, f"the job ended {after:.1f} s after the failure"
    assert_gone(tmp_path)


def start_idle_job(tmp_path, *extra):
    port = rp.distributed.free_port()
    cmd = [*LAUNCH, "-n", "2", "--devices-per-process", "1", "--port", str(port), *extra]
    cmd += ["--", sys.executable, str(WORKER), "idle", "-1", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)):
            return proc, port
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the workers did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_a_signal_to_the_launcher_reaches_the_workers_and_leaves_no_orphan(tmp_path, sig):
    proc, _ = start_idle_job(tmp_path, "--grace", "2")
    try:
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pids = {p.name: p.read_text() for p in tmp_path.glob("rank*.pid")}
            raise AssertionError(
                f"the launcher did not end within 20 s of {sig.name}; workers {pids}; its "
                f"output: {proc.communicate()[0][-3000:]}"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)
    assert_gone(tmp_path)
    assert proc.returncode == 128 + sig, out[-3000:]
    assert f"got {sig.name}" in out, out[-3000:]


def listening_addresses(port: int) -> set[str]:
    """The local addresses that listen on ``port`` (TCP, IPv4 and IPv6), from /proc/net: the
    real sockets, as ``ss -ltn`` shows them. Every interface is 0.0.0.0 or ::."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(host)
                if name == "tcp":
                    found.add(".".join(str(b) for b in raw[::-1]))
                else:  # four 32-bit words in host (little-endian) order
                    ip = ipaddress.IPv6Address(
                        b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    )
                    found.add(str(ip.ipv4_mapped or ip))  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def test_the_coordinator_listens_on_loopback_only(tmp_path):
    proc, port = start_idle_job(tmp_path, "--grace", "1")
    try:
        addresses = listening_addresses(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert addresses == {"127.0.0.1"}, addresses


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", "--", "true"], r"-n must be an int >= 1; got 0"),
        (["-n", "two", "--", "true"], r"-n.*invalid int value: 'two'"),
        (
            ["-n", "2", "--devices-per-process", "-4", "--", "true"],
            r"--devices-per-process.*got -4",
        ),
        (["-n", "2"], r"give the command to run after --"),
        (["-n", "2", "--"], r"give the command to run after --"),
        (["-n", "2", "--", "no-such-command-xyz"], r"command 'no-such-command-xyz' not found"),
        (
            ["-n", "2", "--watchdog", "-1", "--", "true"],
            r"--watchdog must be a number of seconds > 0",
        ),
        (["-n", "2", "--grace", "-1", "--", "true"], r"--grace must be a number of seconds >= 0"),
        (["-n", "2", "--port", "70000", "--", "true"], r"--port must be.*got 70000"),
        (["--", "true"], r"arguments are required: -n/--num-processes"),
        (["-n", "2", "--bogus", "--", "true"], r"unrecognized arguments: --bogus"),
    ],
)
def test_bad_launcher_inputs_are_one_line_and_exit_2(args, message, capsys):
    """``replicator launch``'s checks, in this process (nothing starts before them); the
    entry point as typed is the test below."""
    from replicator.cli import launch

    try:
        code = launch.main(args)
    except SystemExit as e:  # argparse's
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("replicator launch: "), err
    assert __import__("re").search(message, lines[0]), lines[0]


@pytest.mark.slow
def test_a_bad_input_to_python_m_replicator_launch_is_one_line_and_exit_2():
    run = subprocess.run([*LAUNCH, "-n", "0", "--", "true"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == "replicator launch: -n must be an int >= 1; got 0.", run.stderr
