"""Errors the engine raises for bad input (the server answers them with HTTP 400)."""

from __future__ import annotations


class EngineInputError(ValueError):
    """The request cannot be computed as given. ``error_class`` is the machine-readable
    kind the server puts next to the message, e.g. ``InvalidDatum``, ``SequenceTooLong``,
    ``UnknownLoss``, ``UnknownLossConfigKey``, ``NaNInput``."""

    def __init__(self, message: str, error_class: str = "InvalidInput") -> None:
        super().__init__(message)
        self.message = message
        self.error_class = error_class


class UnknownModelError(EngineInputError, LookupError):
    """A base model name the engine cannot load; the message lists the available ones."""

    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(
            f"Unknown base model {name!r}. Available: {', '.join(available)} "
            "(or the path of a local Hugging Face model directory).",
            "UnknownModel",
        )
        self.name = name
        self.available = available


class ModelUnavailableError(EngineInputError):
    """A known model whose weights are not on this machine yet."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "ModelUnavailable")
