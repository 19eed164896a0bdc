"""What every neusight CLI shares: user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from neusight.errors import NeuSightError

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def catch_user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Hydra task function (under ``@hydra.main``): a NeuSightError (bad model, device, shape,
    file) prints ``error: <message>`` in one line and exits 2, without Hydra's traceback; so does a required
    setting (``???`` in the config) left out."""
    from omegaconf.errors import MissingMandatoryValue

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NeuSightError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except MissingMandatoryValue as e:
            key = getattr(e, "full_key", None) or "a required setting"
            print(f"error: {key}= is required and was not given. Fix: add {key}=<value> to the command",
                  file=sys.stderr)
            sys.exit(2)

    return wrapper


def exit_2_on_config_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the console entry point: Hydra's own config errors (unknown key, bad type) exit 2 too."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code not in (0, None):
                sys.exit(2)
            raise

    return wrapper


def quiet_third_party_logs() -> None:
    """transformers warns about config details that do not matter on the meta device."""
    for name in ("transformers", "transformers.modeling_utils", "transformers.configuration_utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
