"""The one exception type for mistakes a user can fix: every concern raises it, every command
turns it into one `error:` line (toolkit.command_line)."""


class ConfigError(ValueError):
  """A config or input mistake the user can fix; the message names the field and the fix."""
