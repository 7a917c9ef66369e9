"""The one error the model layer raises: a model file or directory cannot be used."""


class ModelError(ValueError):
    """A model file or directory cannot be used; the message says why."""
