import jax
import numpy as np
import pytest

from podscale import make_mesh
from podscale.parallel.mesh import default_axis_names, parse_shape, replica_count


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


# -- Every argument checks its type (issue 23, findings 13 and 14) ------------------------------

WRONG_TYPES = [
    ({"shape": "4x2"}, r"shape='4x2' is a str; give a tuple of ints such as \(4, 2\).*parse_shape"),
    ({"shape": (4.5, 2)}, r"dimension 0 \(4.5\) is a float"),
    ({"shape": (4.0, 2)}, r"dimension 0 \(4.0\) is a float"),
    ({"shape": 8.0}, r"shape=8.0 is a float"),
    ({"shape": True}, r"shape=True is a bool"),
    ({"shape": (True, 8)}, r"dimension 0 \(True\) is a bool"),
    ({"shape": ("4", "2")}, r"dimension 0 \('4'\) is a str"),
    ({"shape": {"x": 8}}, r"shape=\{'x': 8\} is a dict"),
    ({"axis_names": "xy", "shape": (4, 2)}, r"axis_names='xy' is one string.*axis_names=\('x', 'y'\)"),
    ({"axis_names": ("x", 2), "shape": (4, 2)}, r"axis_names\[1\]=2 is an int"),
    ({"axis_names": 3}, r"axis_names=3 is an int"),
    ({"bn_group_size": 2.0}, r"bn_group_size=2.0 is a float"),
    ({"bn_group_size": "2"}, r"bn_group_size='2' is a str"),
    ({"bn_group_size": True}, r"bn_group_size=True is a bool"),
    ({"spatial": "2", "shape": (4, 2)}, r"spatial='2' is a str"),
    ({"spatial": 2.0, "shape": (4, 2)}, r"spatial=2.0 is a float"),
]
OUT_OF_RANGE = [
    ({"shape": ()}, r"shape=\(\): give at least one dimension"),
    ({"shape": (8, 0)}, r"every mesh dimension must be at least 1"),
    ({"shape": (-8,)}, r"every mesh dimension must be at least 1"),
    ({"shape": -8}, r"every mesh dimension must be at least 1"),
    ({"bn_group_size": 0}, r"bn_group_size must be at least 1"),
    ({"spatial": 0, "shape": (4, 2)}, r"spatial must be at least 1"),
    ({"spatial": 4, "shape": (4, 2)}, r"spatial=4 needs a mesh whose last axis has 4 devices.*make_mesh\(\(2, 4\)\)"),
    ({"spatial": 3}, r"spatial=3 needs .*3 does not divide the 8 devices"),
]


@pytest.mark.parametrize(("kwargs", "message"), WRONG_TYPES, ids=[str(k) for k, _ in WRONG_TYPES])
def test_a_wrong_type_is_a_type_error_naming_the_argument(kwargs, message):
    with pytest.raises(TypeError, match=message):
        make_mesh(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), OUT_OF_RANGE, ids=[str(k) for k, _ in OUT_OF_RANGE])
def test_a_value_out_of_range_is_a_value_error_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**kwargs)


def test_numpy_and_list_shapes_are_taken_as_they_are():
    assert dict(make_mesh(np.int64(8)).shape) == {"data": 8}
    assert dict(make_mesh([np.int32(4), 2], axis_names=["a", "b"]).shape) == {"a": 4, "b": 2}


@pytest.mark.parametrize("shape", [(8,), (4, 2), (2, 2, 2), (2, 2, 2, 1), (2, 2, 1, 2, 1), (1, 2, 1, 2, 1, 2)])
def test_every_rank_has_default_axis_names(shape):
    mesh = make_mesh(shape)
    assert len(mesh.axis_names) == len(shape) == len(set(mesh.axis_names))
    assert mesh.axis_names == default_axis_names(len(shape))
    assert tuple(mesh.shape.values()) == shape
    if len(shape) <= 4:
        assert mesh.axis_names == (("data",) if len(shape) == 1 else ("x", "y", "z", "w")[: len(shape)])


def test_a_4d_mesh_flag_gets_default_axis_names():
    """``--mesh 2x2x2x1`` used to tell a command-line user to "pass axis_names"."""
    from podscale.cli import parse_shape as cli_shape

    assert make_mesh(cli_shape("2x2x2x1")).axis_names == ("x", "y", "z", "w")
