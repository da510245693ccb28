"""The one error type for user mistakes in meshes and rules."""


class ShardingError(ValueError):
  """A mesh or rules problem the user can fix; the message names the field and the fix."""
