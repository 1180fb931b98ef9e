"""The one error hierarchy of ggrun: the CLI maps BadInput to exit 2 and RuntimeFailure to exit 1.

Messages are single lines that name the thing at fault (a file, a tensor, an option).
"""


class GGRunError(Exception):
    """Base of every error ggrun raises on purpose."""

    exit_code = 1


class BadInput(GGRunError):
    """The user's input is wrong: a missing or corrupt file, an impossible option, an unsupported model."""

    exit_code = 2


class RuntimeFailure(GGRunError):
    """Something failed while running although the input was valid."""

    exit_code = 1


class GraphError(BadInput):
    """Bad use of the graph API: shape or dtype mismatches, naming the tensors involved."""
