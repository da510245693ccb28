"""make_mesh and parse_axis_sizes: sizes, axis order, -1 fill, DCN slices, and every error."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from sharding import ShardingError, make_mesh, parse_axis_sizes


def _device_ids(mesh) -> np.ndarray:
  return np.vectorize(lambda d: d.id)(mesh.devices)


# ---------------------------------------------------------------------------------------------
# parse_axis_sizes
# ---------------------------------------------------------------------------------------------

def test_parse_axis_sizes_keeps_order_and_wildcard():
  assert parse_axis_sizes("data:1,fsdp:-1,tensor:2") == [("data", 1), ("fsdp", -1),
                                                          ("tensor", 2)]


def test_parse_axis_sizes_ignores_spaces_and_empty_entries():
  assert parse_axis_sizes(" tensor : 2 , ,fsdp:4, ") == [("tensor", 2), ("fsdp", 4)]
  assert parse_axis_sizes("") == []


@pytest.mark.parametrize("text, entry", [
    ("data", "data"),            # no size
    ("fsdp:x", "fsdp:x"),        # size not an integer
    ("fsdp:", "fsdp:"),          # empty size
    ("tensor:1:2", "tensor:1:2"),
    (":2", ":2"),                # no axis name
])
def test_parse_axis_sizes_rejects_entries_that_are_not_axis_colon_size(text, entry):
  with pytest.raises(ShardingError,
                     match=rf"mesh\.ici='{text}': entry '{entry}' is not 'axis:size'; "
                           r"write e\.g\. 'fsdp:-1,tensor:2'"):
    parse_axis_sizes(text)


def test_parse_axis_sizes_names_the_given_field():
  with pytest.raises(ShardingError, match=r"^mesh\.dcn='data2':"):
    parse_axis_sizes("data2", field="mesh.dcn")


# ---------------------------------------------------------------------------------------------
# make_mesh: one slice
# ---------------------------------------------------------------------------------------------

def test_wildcard_fills_to_the_device_count_and_order_is_kept():
  mesh = make_mesh([("data", 1), ("fsdp", -1), ("tensor", 2)])
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert mesh.devices.shape == (1, 4, 2)


def test_axis_order_is_the_listed_order_not_the_canonical_one():
  mesh = make_mesh([("tensor", 2), ("data", -1)])
  assert mesh.axis_names == ("tensor", "data")
  assert mesh.devices.shape == (2, 4)


def test_fixed_sizes_without_wildcard():
  mesh = make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  # Every device appears exactly once.
  assert sorted(_device_ids(mesh).flat) == list(range(8))


def test_axis_types_are_auto():
  mesh = make_mesh(parse_axis_sizes("data:2,fsdp:-1"))
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_subset_of_devices():
  devices = jax.devices()[:4]
  mesh = make_mesh([("fsdp", -1), ("tensor", 2)], devices=devices)
  assert dict(mesh.shape) == {"fsdp": 2, "tensor": 2}
  assert set(mesh.devices.flat) == set(devices)


def test_subset_of_devices_checks_sizes_against_the_subset():
  with pytest.raises(ShardingError, match=r"uses 8 devices per slice but there are 4"):
    make_mesh([("fsdp", 4), ("tensor", 2)], devices=jax.devices()[:4])


# ---------------------------------------------------------------------------------------------
# make_mesh: several slices (DCN) on CPU devices, which have no slice ids
# ---------------------------------------------------------------------------------------------

def test_dcn_multiplies_into_the_ici_axis_with_blocked_slices():
  mesh = make_mesh(parse_axis_sizes("data:1,fsdp:-1,tensor:2"),
                   parse_axis_sizes("data:2", field="mesh.dcn"))
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert mesh.axis_types == (AxisType.Auto,) * 3
  ids = _device_ids(mesh)
  # Without slice ids, consecutive blocks of devices act as slices: slice 0 (data index 0)
  # holds the first 4 devices, slice 1 the last 4, each laid out as fsdp x tensor.
  np.testing.assert_array_equal(ids[0], [[0, 1], [2, 3]])
  np.testing.assert_array_equal(ids[1], [[4, 5], [6, 7]])


def test_dcn_is_outermost_within_a_shared_axis():
  # fsdp spans 2 slices x 2 devices: neighbours along fsdp share a slice, the slice changes
  # only at the outer (DCN) step.
  mesh = make_mesh([("data", 2), ("fsdp", -1)], [("fsdp", 2)])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
  ids = _device_ids(mesh)
  slice_of = ids // 4
  np.testing.assert_array_equal(slice_of, [[0, 0, 1, 1], [0, 0, 1, 1]])
  assert sorted(ids.flat) == list(range(8))


def test_dcn_wildcard_on_devices_without_slice_ids_is_one_slice():
  mesh = make_mesh([("data", 1), ("fsdp", -1)], [("data", -1)])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 8}


# ---------------------------------------------------------------------------------------------
# make_mesh: errors, each naming the field, the value and the fix
# ---------------------------------------------------------------------------------------------

def test_unknown_axis():
  with pytest.raises(ShardingError,
                     match=r"mesh\.ici: unknown mesh axis 'model'; use one of population, data, "
                           r"stage, fsdp, "
                           r"sequence, expert, tensor"):
    make_mesh([("model", -1)])


def test_duplicate_axis():
  with pytest.raises(ShardingError,
                     match=r"mesh\.ici: mesh axis 'fsdp' is listed twice; list each once"):
    make_mesh([("fsdp", 2), ("tensor", 2), ("fsdp", 2)])


def test_two_wildcards():
  with pytest.raises(ShardingError,
                     match=r"mesh\.ici: axes fsdp and tensor are both -1; at most one size per "
                           r"tier may be -1"):
    make_mesh([("data", 1), ("fsdp", -1), ("tensor", -1)])


@pytest.mark.parametrize("size", [0, -2])
def test_size_zero_or_negative(size):
  with pytest.raises(ShardingError,
                     match=rf"mesh\.ici: axis tensor={size}; sizes must be >= 1 \(or -1 to fill\)"):
    make_mesh([("fsdp", -1), ("tensor", size)])


def test_sizes_not_multiplying_to_device_count():
  with pytest.raises(ShardingError,
                     match=r"mesh\.ici: fsdp:3,tensor:2 uses 6 devices per slice but there are 8; "
                           r"sizes must multiply to 8 \(or set one size to -1\)"):
    make_mesh([("fsdp", 3), ("tensor", 2)])


def test_fixed_sizes_not_dividing_with_wildcard():
  with pytest.raises(ShardingError,
                     match=r"mesh\.ici: the fixed sizes multiply to 3, which does not divide 8 "
                           r"devices per slice; choose sizes whose product divides 8"):
    make_mesh([("fsdp", -1), ("tensor", 3)])


def test_dcn_axis_not_in_ici():
  with pytest.raises(ShardingError,
                     match=r"mesh\.dcn: axis 'data' is not in mesh\.ici; list it there too "
                           r"\(size 1 is fine\)"):
    make_mesh([("fsdp", -1), ("tensor", 2)], [("data", 2)])


def test_dcn_slices_not_dividing_devices():
  with pytest.raises(ShardingError,
                     match=r"mesh\.dcn: 3 slices do not divide 8 devices; choose sizes whose "
                           r"product divides 8"):
    make_mesh([("data", 1), ("fsdp", -1)], [("data", 3)])


def test_dcn_errors_name_the_dcn_field():
  with pytest.raises(ShardingError, match=r"^config\.dcn: unknown mesh axis 'pod'"):
    make_mesh([("fsdp", -1)], [("pod", 2)], dcn_field="config.dcn")


def test_ici_errors_name_the_given_field():
  with pytest.raises(ShardingError, match=r"^config\.ici: mesh axis 'data' is listed twice"):
    make_mesh([("data", 4), ("data", 2)], ici_field="config.ici")
