"""Mesh construction and its errors."""

import jax
import pytest

import replicator as rp


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
