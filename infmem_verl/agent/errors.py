"""The one error type for bad configuration, below every module that validates a config."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""
