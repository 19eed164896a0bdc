"""What every neusight CLI shares: user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

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


def each_gpu(devices: list, what: str, enabled: bool = True) -> Iterator:
    """``devices`` (GPUs, or forecasts on them) one by one, with a progress bar on stderr naming the GPU under way
    when ``enabled``, there are several and stderr is a terminal (a search per GPU takes seconds, over the whole
    library minutes); cleared at the end, so what is printed after it reads as without it."""
    if not enabled or len(devices) < 2:
        yield from devices
        return
    from tqdm import tqdm

    bar = tqdm(total=len(devices), desc=what, unit="GPU", leave=False, disable=None, file=sys.stderr)
    try:
        for dev in devices:
            bar.set_postfix_str(str(getattr(getattr(dev, "device", dev), "key", dev)), refresh=True)
            yield dev
            bar.update()
    finally:
        bar.close()
