"""One error hierarchy for everything a user can get wrong; caught only at the CLI boundary."""

from __future__ import annotations


class NeuSightError(Exception):
    """Base class of every error neusight raises on bad input; the CLI prints it in one line, exit 2."""


class DeviceError(NeuSightError, ValueError):
    """Unknown GPU name, or a malformed device spec file."""


class ModelError(NeuSightError, ValueError):
    """Unknown model preset, malformed config, or a module that cannot run on the meta device."""


class TraceError(NeuSightError, RuntimeError):
    """The tracer met an op it cannot follow on the meta device (data-dependent control flow)."""


class InputError(NeuSightError, ValueError):
    """Impossible run parameters: batch size 0, negative sequence length, unknown mode."""


class ContextParallelError(InputError):
    """Context parallelism asked of a model or run it cannot split that way (eager attention, explicit masks, sliding
    windows, generation): whatever the layout, so a plan searching ``cp`` drops it rather than each layout."""


class ContextCommError(InputError):
    """A context-parallel exchange (``cp_comm``) that cannot run one layout (Ulysses' all-to-all over more GPUs than
    the key / value heads on each): a plan searching the exchanges drops it there, keeping the others."""


class DataError(NeuSightError, ValueError):
    """A trace CSV or dataset that cannot be used (missing columns, no usable rows)."""


class CheckpointError(NeuSightError, ValueError):
    """A predictor checkpoint that is missing, corrupt, or does not match the code."""
