import jax
import pytest

from podscale import make_mesh
from podscale.parallel.mesh import parse_shape, replica_count


def test_default_mesh_is_1d_over_all_devices():
    mesh = make_mesh()
    assert mesh.axis_names == ("data",)
    assert mesh.devices.size == jax.device_count() == 8


def test_2d_mesh_default_axis_names():
    mesh = make_mesh((4, 2))
    assert mesh.axis_names == ("x", "y")
    assert dict(mesh.shape) == {"x": 4, "y": 2}
    assert replica_count(mesh) == 8


def test_mesh_larger_than_device_count_names_the_count():
    with pytest.raises(ValueError, match=r"needs 16 devices, but there are 8"):
        make_mesh((4, 4))


def test_mesh_axis_names_must_match_rank():
    with pytest.raises(ValueError, match="axis_names"):
        make_mesh((4, 2), axis_names=("data",))


def test_parse_shape():
    assert parse_shape("4x2") == (4, 2)
    assert parse_shape("8") == (8,)
    with pytest.raises(ValueError, match="4x2"):
        parse_shape("four")


def test_bn_groups_are_neighbouring_replicas_on_an_inner_axis():
    mesh = make_mesh(bn_group_size=4)
    assert dict(mesh.shape) == {"data": 2, "bn_group": 4}
    ids = [[d.id for d in row] for row in mesh.devices]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_bn_group_size_must_divide_the_last_mesh_dimension():
    with pytest.raises(
        ValueError, match=r"bn_group_size=3 must be a positive divisor of the last mesh dimension \(data=8"
    ):
        make_mesh(bn_group_size=3)
