"""Mesh construction and its errors."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator._src.core import mesh as mesh_lib


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
        r"'data', 'stage', 'expert', 'context', 'model'\)",
    ):
        mesh_lib.fit_spec(P("stag"), mesh, api="Replicator.place")
    with pytest.raises(TypeError, match=r"Replicator.place: spec must be a PartitionSpec"):
        mesh_lib.fit_spec("stage", mesh, api="Replicator.place")


# -- multi-slice meshes ---------------------------------------------------------------------------


class FakeTpu:
    """A stand-in for one chip of a multi-slice TPU: what JAX's mesh builders read of a device."""

    platform = "tpu"
    device_kind = "TPU v4"
    core_on_chip = 0

    def __init__(self, id, slice_index, coords, process_index):
        self.id, self.slice_index, self.coords = id, slice_index, coords
        self.process_index = process_index

    def __repr__(self):
        return f"FakeTpu(id={self.id}, slice={self.slice_index})"


def fake_slices(num_slices, x=2, y=2):
    """``num_slices`` slices of ``x * y`` chips each (coords per slice), two chips per host."""
    per = x * y
    return [
        FakeTpu(s * per + i, s, (i % x, i // x, 0), (s * per + i) // 2)
        for s in range(num_slices)
        for i in range(per)
    ]


def slice_of(index, mesh):
    return {d.slice_index for d in mesh.devices[index].flat}


def no_hybrid(*args, **kwargs):
    raise AssertionError("create_hybrid_device_mesh was called")


def test_multi_slice_puts_one_slice_on_each_dcn_data_index(monkeypatch):
    from jax.experimental import mesh_utils

    devices = fake_slices(2)
    shuffled = devices[4:6] + devices[:4] + devices[6:]  # order of the list does not matter
    mesh = mesh_lib.build_mesh({"data": 2, "dcn_data": 2, "stage": 2}, devices=shuffled)
    assert dict(mesh.shape) == {"dcn_data": 2, "data": 2, "stage": 2}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
    assert [slice_of(i, mesh) for i in range(2)] == [{0}, {1}]
    for s in range(2):  # inside a slice: the layout jax.make_mesh gives that slice alone
        alone = jax.make_mesh((2, 2), ("data", "stage"), devices=devices[4 * s : 4 * s + 4])
        assert [d.id for d in mesh.devices[s].flat] == [d.id for d in alone.devices.flat]
    # dcn_data filled with -1, and a multiple of the slice count: slice i // 2 at index i.
    filled = mesh_lib.build_mesh({"dcn_data": -1, "data": 4}, devices=fake_slices(2))
    assert dict(filled.shape) == {"dcn_data": 2, "data": 4}
    twice = mesh_lib.build_mesh({"dcn_data": 4, "data": 2}, devices=fake_slices(2))
    assert [slice_of(i, twice) for i in range(4)] == [{0}, {0}, {1}, {1}]
    # Single slice (or CPU, whose devices have no slice_index): jax.make_mesh as before.
    monkeypatch.setattr(mesh_utils, "create_hybrid_device_mesh", no_hybrid)
    one = fake_slices(1)
    mesh = mesh_lib.build_mesh({"data": 2, "model": 2}, devices=one)
    same = jax.make_mesh((2, 2), ("data", "model"), devices=one)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in same.devices.flat]


def test_without_dcn_data_a_pipeline_s_stages_cross_the_slices():
    """``{"stage": 2, "data": 4}`` on 2 slices: stage ``j`` is slice ``j``, and ``data`` stays
    inside each; ``stage: 4`` puts two consecutive stages on each slice."""
    mesh = mesh_lib.build_mesh({"stage": 2, "data": 4}, devices=fake_slices(2))
    assert dict(mesh.shape) == {"data": 4, "stage": 2}
    stage = mesh.axis_names.index("stage")
    for j in range(2):
        assert {d.slice_index for d in np.take(mesh.devices, j, axis=stage).flat} == {j}
    four = mesh_lib.build_mesh({"stage": 4, "data": 2}, devices=fake_slices(2))
    stage = four.axis_names.index("stage")
    got = [{d.slice_index for d in np.take(four.devices, j, axis=stage).flat} for j in range(4)]
    assert got == [{0}, {0}, {1}, {1}]


def test_a_cpu_mesh_is_built_as_before(monkeypatch):
    from jax.experimental import mesh_utils

    monkeypatch.setattr(mesh_utils, "create_hybrid_device_mesh", no_hybrid)
    assert not hasattr(jax.devices()[0], "slice_index")
    mesh = mesh_lib.build_mesh({"dcn_data": 2, "data": 2, "model": 2})
    expected = jax.make_mesh(
        (2, 2, 2),
        ("dcn_data", "data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 3,
        devices=jax.devices(),
    )
    assert mesh == expected and mesh.devices.tolist() == expected.devices.tolist()


def test_a_layout_that_puts_another_axis_across_slices_is_refused(monkeypatch):
    from jax.experimental import mesh_utils

    monkeypatch.setattr(mesh_utils, "create_hybrid_device_mesh", no_hybrid)
    monkeypatch.setattr(jax, "make_mesh", no_hybrid)
    with pytest.raises(
        ValueError,
        match=r"^Replicator: the devices span 2 slices, and 'dcn_data' is the mesh axis laid "
        r"out across slices \(or, without it, 'stage': a pipeline's stages\), but "
        r"mesh_shape=\{'data': -1\} has no 'dcn_data' axis\. Give 'dcn_data' a multiple of 2 "
        r"\(the slice count\): mesh_shape=\{'dcn_data': 2, 'data': -1\}\.$",
    ):
        rp.Replicator(mesh_shape={"data": -1}, devices=fake_slices(2))
    with pytest.raises(
        ValueError,
        match=r"the devices span 4 slices.*mesh_shape=\{'dcn_data': 2, 'data': 2, 'stage': 2\} "
        r"gives 'dcn_data' 2\. Give 'dcn_data' a multiple of 4 \(the slice count\): "
        r"mesh_shape=\{'dcn_data': 4, 'data': -1, 'stage': 2\}\.$",
    ):
        mesh_lib.build_mesh({"dcn_data": 2, "data": 2, "stage": 2}, devices=fake_slices(4, 2, 1))
    uneven = fake_slices(2)[:6]
    with pytest.raises(
        ValueError,
        match=r"the devices span 2 slices of different sizes \(slice 0: 4 devices, slice 1: 2\).*"
        r"pass every device of each slice",
    ):
        mesh_lib.build_mesh({"dcn_data": 2, "data": 3}, devices=uneven)
