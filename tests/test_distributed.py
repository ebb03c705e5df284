"""rp.distributed in this process: initialize's checks, and the launcher's bookkeeping."""

import io
import sys

import jax
import pytest

import replicator as rp


def test_initialize_after_jax_started_says_what_to_move(monkeypatch):
    jax.devices()  # the backend is up in this process
    info = rp.distributed.initialize()  # alone, nothing to set: a no-op
    assert (info.process_index, info.process_count, info.source) == (0, 1, "single")
    monkeypatch.setenv("REPLICATOR_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("REPLICATOR_NUM_PROCESSES", "2")
    monkeypatch.setenv("REPLICATOR_PROCESS_ID", "0")
    with pytest.raises(
        RuntimeError, match=r"already initialised.*Call rp.distributed.initialize\(\) at the top"
    ):
        rp.distributed.initialize()


def run_launch(code: str, n: int = 2):
    out = io.StringIO()
    rc = rp.distributed.launch([sys.executable, "-c", code], num_processes=n, grace=2, out=out)
    return rc, out.getvalue()


def test_launch_prefixes_ranks_and_passes_exit_codes():
    rc, out = run_launch("import os; print('hello from', os.environ['REPLICATOR_PROCESS_ID'])")
    assert rc == 0
    assert "[0] hello from 0" in out and "[1] hello from 1" in out
    code = "import os, sys, time; r = os.environ['REPLICATOR_PROCESS_ID']; r == '1' and sys.exit(3); time.sleep(60)"
    rc, out = run_launch(code)
    assert rc == 3 and "rank 1 exited with 3; stopped the other 1 process(es)" in out, out


def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match=r"-n must be an int >= 1"):
        rp.distributed.launch(["true"], num_processes=0)
    with pytest.raises(ValueError, match=r"give the command to run after --"):
        rp.distributed.launch([], num_processes=1)


def test_heartbeat_is_a_no_op_alone_and_writes_the_launchers_file(tmp_path, monkeypatch):
    import time

    from replicator._src.distributed import beat

    monkeypatch.setattr(beat, "_page", [])
    monkeypatch.delenv("REPLICATOR_HEARTBEAT_FILE", raising=False)
    rp.distributed.heartbeat()  # no launcher: nothing to write, nothing raised
    assert beat._page == [None]
    path = tmp_path / "rank0.beat"
    beat.create(str(path))
    assert beat.read_beat(str(path)) == beat.EMPTY
    monkeypatch.setattr(beat, "_page", [])
    monkeypatch.setattr(beat, "_mine", dict(beat.EMPTY._asdict()))
    monkeypatch.setenv("REPLICATOR_HEARTBEAT_FILE", str(path))
    before = time.monotonic()
    rp.distributed.heartbeat(7)
    rp.distributed.heartbeat()  # no step: the last one stays
    beat.checkpointed(5)
    got = beat.read_beat(str(path))
    assert before <= got.time <= time.monotonic() and got.how == beat.RUNNING
    assert (got.reports, got.step, got.checkpoint, got.ready) == (2, 7, 5, 0.0)


def test_the_coordinator_binds_to_loopback_only_for_a_loopback_address():
    from replicator._src.distributed.initialize import _is_loopback

    assert (
        _is_loopback("127.0.0.1:1234") and _is_loopback("localhost:1") and _is_loopback("[::1]:5")
    )
    assert not _is_loopback("10.0.0.1:1234") and not _is_loopback("myhost:1234")


def test_replicator_launch_takes_the_launchers_options(capsys):
    from replicator.cli import main

    assert main(["launch", "--watchdog", "0", "-n", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "replicator launch: --watchdog must be a number of seconds > 0 (or left out for no "
        "watchdog); got 0.0.\n"
    )
    assert main(["launch", "--watchdog", "5", "-n", "2", "--", sys.executable, "-c", "1"]) == 0


def test_the_first_failure_is_named_even_when_a_peer_is_seen_to_end_first(tmp_path):
    """Rank 1 is SIGKILLed; rank 0's all-reduce then fails, and the launcher happens to see rank
    0 end first: rank 1 is still the one named. An own failure comes before either."""
    import threading

    from replicator._src.distributed import beat, rounds
    from replicator._src.distributed import initialize as distributed

    job = rounds.Job(("true",), 3, None, 1.0, None, sys.stdout, threading.Lock(), 0)
    rnd = rounds.Round(job, [0, 1, 2])

    def mark(rank, t, how):
        beat.create(rnd.beat_files[rank])
        with open(rnd.beat_files[rank], "r+b") as f:
            f.write(beat.BEAT.pack(t, how, 3, 0, 0, 1.0))

    for rank, (t, how) in enumerate([(10.0, beat.FAILED_IN_RUNTIME), (0.0, beat.RUNNING)]):
        mark(rank, t, how)
    mark(2, 0.0, beat.RUNNING)
    rnd.exits.put((1, -9, 10.2))  # seen after rank 0's exit, though it failed first
    assert rnd._first_failure({0: (1, 10.1)}, {1, 2}) == (1, -9)
    mark(2, 10.3, beat.FAILED)  # rank 2: sys.exit(3)
    rnd.exits.put((1, -9, 10.2))
    rnd.exits.put((2, 3, 10.4))
    assert rnd._first_failure({0: (1, 10.1)}, {1, 2}) == (2, 3)
    rnd.close()
    assert distributed._runtime_error(ValueError("UNKNOWN: Gloo all-reduce failed: reset"))
    assert not distributed._runtime_error(ValueError("bad batch"))


# -- cluster detection: JAX's own, asked without the network ------------------------------------

CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "MEGASCALE_", "REPLICATOR_", "JAX_")


def jax_picks(method):
    """The cluster environment jax.distributed.initialize uses for this cluster_detection_method."""
    from jax._src import clusters

    return next(env for env in clusters.ClusterEnv._cluster_types if env.name == method)


@pytest.fixture
def joins(monkeypatch):
    """A process that has not started JAX yet, on a machine with no cluster and no network: the
    calls initialize makes to jax.distributed.initialize are recorded, not made."""
    import os
    import socket

    from replicator._src.core import compat

    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES) or name == "JOB_COMPLETION_INDEX":
            monkeypatch.delenv(name)
    calls = []
    monkeypatch.setattr(compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(
        jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs))
    )

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access during cluster detection: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    for name in ("create_connection", "getaddrinfo", "gethostbyname"):
        monkeypatch.setattr(socket, name, no_network)
    return calls


def resolved(kwargs):
    """What JAX makes of the arguments initialize passed: (address, count, id, local devices)."""
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, kwargs["cluster_detection_method"], None
    )


def test_no_cluster_is_one_process_and_asks_no_network(joins):
    info = rp.distributed.initialize()
    assert info == rp.distributed.ProcessInfo(0, 1, "single") and info.cluster is None
    assert joins == []


def test_slurm_is_found_by_jax_detection(joins, monkeypatch):
    for name, value in {
        "SLURM_JOB_ID": "4097",
        "SLURM_STEP_NODELIST": "node[007-008]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    info = rp.distributed.initialize()
    assert info.source == "cluster" and info.cluster == "SlurmCluster"
    [(args, kwargs)] = joins
    assert args == (None, None, None, None)
    assert jax_picks(kwargs["cluster_detection_method"]).__name__ == "SlurmCluster"
    assert resolved(kwargs) == ("node007:61441", 2, 1, [0])
    assert kwargs["heartbeat_timeout_seconds"] == 30
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task job: alone, as before
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert rp.distributed.initialize().source == "single" and len(joins) == 1


def test_open_mpi_is_found_by_jax_detection(joins, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    with pytest.raises(
        RuntimeError,
        match=r"rank 2 of 4 \(OMPI_COMM_WORLD_SIZE=4\).*found no cluster it can join.*"
        r"(OMPI_MCA_orte_hnp_uri|mpi4py, which is not installed).*"
        r"initialize\(coordinator_address='HOST:PORT', "
        r"num_processes=4, process_id=2\)",
    ):
        rp.distributed.initialize()  # Open MPI 5 sets no orte URI: refused, not 4 lone runs
    assert joins == []
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    info = rp.distributed.initialize()
    assert (info.source, info.cluster) == ("cluster", "OmpiCluster")
    [(_, kwargs)] = joins
    assert jax_picks(kwargs["cluster_detection_method"]).__name__ == "OmpiCluster"
    assert resolved(kwargs) == ("10.96.0.1:62624", 4, 2, [0])


def test_kubernetes_is_found_with_the_kubernetes_package_and_skipped_without(joins, monkeypatch):
    import types

    from jax._src.clusters import K8sCluster

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # not installed
    with pytest.warns(UserWarning, match=r"the `kubernetes` package is not\sinstalled"):
        info = rp.distributed.initialize()
    assert info.source == "single" and joins == []
    # With the package (a stand-in: loading the in-cluster config reads files, no network).
    for attr in ("_core_api", "_batch_api", "_ApiException"):
        monkeypatch.setattr(K8sCluster, attr, None, raising=False)  # set by is_env_present
    k8s = types.ModuleType("kubernetes")
    k8s.config = types.SimpleNamespace(load_incluster_config=lambda: None)
    k8s.client = types.SimpleNamespace(
        CoreV1Api=object, BatchV1Api=object, exceptions=types.SimpleNamespace(ApiException=OSError)
    )
    monkeypatch.setitem(sys.modules, "kubernetes", k8s)
    info = rp.distributed.initialize()
    assert (info.source, info.cluster) == ("cluster", "K8sCluster")
    [(_, kwargs)] = joins
    assert jax_picks(kwargs["cluster_detection_method"]) is K8sCluster

    def outside_a_pod():
        raise OSError("Service host/port is not set.")

    k8s.config.load_incluster_config = outside_a_pod
    with pytest.raises(
        RuntimeError,
        match=r"JAX's cluster detection K8sCluster failed: OSError: Service host/port is not "
        r"set\..*pass coordinator_address, num_processes, process_id and local_device_ids",
    ):
        rp.distributed.initialize()


def test_the_metadata_server_is_asked_only_on_a_cloud_tpu_vm(joins, monkeypatch):
    from jax._src.clusters import cloud_tpu_cluster

    asked = []

    def metadata(key):
        asked.append(key)
        return "0", 200

    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", metadata)
    # A laptop (no TPU chips found by JAX), even without TPU_SKIP_MDS_QUERY: nothing asked.
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", False)
    assert rp.distributed.initialize().source == "single" and asked == []
    # A TPU VM told not to query (TPU_SKIP_MDS_QUERY, which JAX sets where it finds no chips).
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    assert rp.distributed.initialize().source == "single" and asked == []
    # ... on GKE, whose variables say it all: found without the metadata server.
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host0,host1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    info = rp.distributed.initialize()
    assert (info.source, info.cluster) == ("cluster", "GkeTpuCluster") and asked == []
    assert jax_picks(joins[-1][1]["cluster_detection_method"]).__name__ == "GkeTpuCluster"
    # A GCE TPU VM: JAX's own detection asks the metadata server, and so do we.
    for name in ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"):
        monkeypatch.delenv(name)
    info = rp.distributed.initialize()
    assert (info.source, info.cluster) == ("cluster", "GceTpuCluster")
    assert asked == ["agent-worker-number"]


def test_the_launcher_turns_jax_detection_off(joins, monkeypatch):
    monkeypatch.setenv("REPLICATOR_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("REPLICATOR_NUM_PROCESSES", "2")
    monkeypatch.setenv("REPLICATOR_PROCESS_ID", "1")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")  # would restrict the devices to [3]
    from replicator._src.distributed import initialize as distributed

    monkeypatch.setattr(distributed, "_end_fast_under_launcher", lambda: None)
    info = rp.distributed.initialize()
    assert (info.source, info.cluster) == ("launcher", None)
    [(args, kwargs)] = joins
    assert args == ("127.0.0.1:1234", 2, 1, None)
    assert kwargs["cluster_detection_method"] == "deactivate"
    assert kwargs["coordinator_bind_address"] == "127.0.0.1:1234"


def test_a_second_call_after_joining_returns_what_jax_sees(joins, monkeypatch):
    from replicator._src.core import compat

    monkeypatch.setattr(compat, "backends_initialized", lambda: True)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv("REPLICATOR_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("REPLICATOR_NUM_PROCESSES", "2")
    monkeypatch.setenv("REPLICATOR_PROCESS_ID", "1")
    info = rp.distributed.initialize()
    assert (info.process_index, info.process_count, info.source) == (0, 1, "launcher")
    assert joins == []


def test_launch_takes_its_restart_options_as_a_record_and_the_old_keywords_with_a_warning():
    """`rp.distributed.Restarts` holds what the five restart keywords held; the old keywords
    still work for one release, with a warning, and run the same job."""
    code = "print('ran')"
    out = io.StringIO()
    rc = rp.distributed.launch(
        [sys.executable, "-c", code], num_processes=1, grace=1, out=out,
        restarts=rp.distributed.Restarts(max_restarts=1, backoff=0.0),
    )  # fmt: skip
    assert rc == 0 and "ran" in out.getvalue()
    old = io.StringIO()
    with pytest.warns(DeprecationWarning, match=r"launch\(max_restarts, restart_backoff=...\)"):
        rc = rp.distributed.launch(
            [sys.executable, "-c", code], num_processes=1, grace=1, out=old,
            max_restarts=1, restart_backoff=0.0,
        )  # fmt: skip
    assert rc == 0 and old.getvalue() == out.getvalue()
    with pytest.raises(ValueError, match="restarts= and max_restarts are both given"):
        rp.distributed.launch(
            ["true"], num_processes=1, restarts=rp.distributed.Restarts(), max_restarts=1
        )
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_restart'"):
        rp.distributed.launch(["true"], num_processes=1, max_restart=1)
    with pytest.raises(ValueError, match="--max-restarts must be an int >= 0"):
        rp.distributed.launch(
            ["true"], num_processes=1, restarts=rp.distributed.Restarts(max_restarts=-1)
        )
