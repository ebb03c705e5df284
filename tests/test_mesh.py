"""Mesh construction and its errors."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator._src import mesh as mesh_lib


def test_fill_and_axis_order():
    repl = rp.Replicator(mesh_shape={"stage": 2, "data": -1})
    assert dict(repl.mesh.shape) == {"data": 4, "stage": 2}
    assert repl.mesh.axis_names == ("data", "stage")
    assert repl.num_replicas == 4 and repl.replica_axes == ("data",)
    multi = rp.Replicator(mesh_shape={"data": 2, "dcn_data": 2, "model": 2})
    assert multi.replica_axes == ("dcn_data", "data") and multi.num_replicas == 4


def test_devices_subset():
    repl = rp.Replicator(devices=jax.devices()[:4])
    assert repl.num_replicas == 4
    assert "num_replicas=4" in repr(repl)


def test_unknown_axis():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'batch'.*Known axes are 'dcn_data'"):
        rp.Replicator(mesh_shape={"batch": 8})


def test_product_must_equal_device_count():
    with pytest.raises(
        ValueError, match=r"needs 6 devices but 8 are available.*devices=jax.devices\(\)\[:6\]"
    ):
        rp.Replicator(mesh_shape={"data": 3, "stage": 2})
    with pytest.raises(
        ValueError, match=r"cannot fill axis 'data'.*3 devices, which does not divide the 8"
    ):
        rp.Replicator(mesh_shape={"data": -1, "stage": 3})
    with pytest.raises(ValueError, match="only one mesh axis may be -1"):
        rp.Replicator(mesh_shape={"data": -1, "stage": -1})
    with pytest.raises(ValueError, match=r"mesh_shape\['data'\] must be a positive int or -1"):
        rp.Replicator(mesh_shape={"data": 0})


def test_lowering_checks():
    with pytest.raises(
        ValueError, match="lowering='xla' is not one of 'shard_map', 'pmap', 'local'"
    ):
        rp.Replicator(lowering="xla")
    with pytest.raises(ValueError, match=r"pmap maps over replicas only.*\{'stage': 2\}"):
        rp.Replicator(mesh_shape={"data": 4, "stage": 2}, lowering="pmap")
    with pytest.raises(ValueError, match="has no data axis"):
        rp.Replicator(mesh_shape={"stage": 8})
    with pytest.raises(ValueError, match=r"lowering='local'\) runs one replica on one device"):
        rp.Replicator(lowering="local", devices=jax.devices()[:2])


def test_more_devices_than_there_are_says_how_to_get_them():
    with pytest.raises(ValueError) as info:
        rp.Replicator(mesh_shape={"data": 16})
    message = str(info.value)
    assert "mesh_shape={'data': 16} needs 16 devices but 8 are available" in message
    assert 'jax.config.update("jax_num_cpu_devices", 16)' in message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in message
    assert "before JAX initialises its backend" in message
    assert "the first jax.devices() or array creation" in message
    assert "replicator train CONFIG cpu_devices=16" in message
    with pytest.raises(
        ValueError,
        match=r"the other axes use 16 devices, more than the 8 available.*"
        r'jax_num_cpu_devices", 16\)',
    ):
        rp.Replicator(mesh_shape={"data": -1, "stage": 16})
    # With fewer devices passed than the mesh needs, but enough in the process: pass them.
    with pytest.raises(
        ValueError, match=r"needs 8 devices but 4 are available.*devices=jax.devices\(\)\[:8\]"
    ):
        rp.Replicator(mesh_shape={"data": 8}, devices=jax.devices()[:4])


def test_fit_spec_drops_known_axes_the_mesh_lacks_and_refuses_typos():
    mesh = mesh_lib.build_mesh({"data": 8})
    assert mesh_lib.fit_spec(P("stage"), mesh, api="Replicator.place") == P()
    assert mesh_lib.fit_spec(P(None, "stage"), mesh, api="Replicator.place") == P()
    assert mesh_lib.fit_spec(P("data", "stage"), mesh, api="x") == P("data")
    assert mesh_lib.fit_spec(P(("dcn_data", "data")), mesh, api="x") == P("data")
    spec = P("data", None)
    assert mesh_lib.fit_spec(spec, mesh, api="x") is spec  # nothing to drop: the same spec
    staged = mesh_lib.build_mesh({"data": 2, "stage": 4})
    assert mesh_lib.fit_spec(P("stage"), staged, api="x") == P("stage")
    with pytest.raises(
        ValueError,
        match=r"Replicator.place: spec P\('stag',\) names axis 'stag', which is not an axis of "
        r"this mesh \(\{'data': 8\}; axes 'data'\) nor one replicator knows \('dcn_data', "
        r"'data', 'stage', 'model'\)",
    ):
        mesh_lib.fit_spec(P("stag"), mesh, api="Replicator.place")
    with pytest.raises(TypeError, match=r"Replicator.place: spec must be a PartitionSpec"):
        mesh_lib.fit_spec("stage", mesh, api="Replicator.place")
