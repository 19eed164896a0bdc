"""What every neusight CLI shares: user errors become one line on stderr and exit code 2; ``--help`` says what
every option does (the comment beside it in the config dataclass) and its default."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import sys
import textwrap
import typing
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


def _field_comments(schema: type, prefix: str = "") -> dict[str, str]:
    """``dotted.option -> the comment written beside it`` in a config dataclass's source (a field's line and the
    ``#`` lines under it), nested dataclass fields under their field's name."""
    lines, _ = inspect.getsourcelines(schema)
    found: dict[str, str] = {}
    current, above = None, ""   # the field a comment line continues; comment lines above the next field
    for line in lines[1:]:
        m = re.match(r"^    (\w+)\s*:[^#]*?(?:#\s?(.*))?$", line.rstrip())
        comment = re.match(r"^\s+#(\s*)(.*)$", line.rstrip())
        if m:
            current = prefix + m.group(1)
            found[current] = " ".join(t for t in (above, (m.group(2) or "").strip()) if t)
            above = ""
        elif comment and current and len(comment.group(1)) > 1:   # "#     ..." under a field's own comment
            found[current] = (found[current] + " " + comment.group(2)).strip()
        elif comment:                                              # "# ..." above the next field
            above = (above + " " + comment.group(2)).strip()
            current = None
        else:
            current, above = None, ""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints.get(f.name)):
            found.update(_field_comments(hints[f.name], f"{prefix}{f.name}."))
    return found


def _shown(value: Any) -> str:
    """An option's default as it would be typed on the command line."""
    if value is None:
        return "null"
    if value == "???":
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def options_help(tool: str, config_name: str, schema: type, doc: str | None, width: int = 116) -> str:
    """``<tool> --help``: what the command does (its module docstring), then every option with its default (the
    composed config's, conf/<config_name>.yaml over the dataclass) and the comment beside it in ``schema``'s
    source; a group of options from a Hydra config group without comments is one line."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name=config_name)
    values = OmegaConf.to_container(cfg, resolve=False)
    comments = _field_comments(schema)
    rows: list[tuple[str, str]] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = prefix + str(key)
            note = comments.get(name, "")
            if isinstance(value, dict) and any(c.startswith(name + ".") for c in comments):
                walk(value, name + ".")
            elif isinstance(value, dict) and value:   # a config group's settings
                count = len(leaves(value))
                rows.append((name + ".*", "; ".join(t for t in (note, f"{count} settings, in conf/{name}/") if t)))
            else:
                rows.append((name, f"{note} (default: {_shown(value)})" if note else f"(default: {_shown(value)})"))

    def leaves(node: Any) -> list:
        return [leaf for v in node.values() for leaf in leaves(v)] if isinstance(node, dict) else [node]

    walk(values, "")
    head = re.sub(r":(?:class|func|mod|meth|attr):", "", textwrap.dedent(doc or "").strip().replace("``", "`"))
    out = [f"usage: {tool} option=value ...   (Hydra overrides; {tool} --hydra-help: Hydra's own flags)", "",
           head, "", "options:"]
    pad = max(len(n) for n, _ in rows) + 4 if rows else 4
    pad = min(pad, 28)
    for name, text in rows:
        first = f"  {name:<{pad - 2}}"
        if len(first) > pad:
            out.append(first.rstrip())
            first = " " * pad
        out += textwrap.wrap(text, width, initial_indent=first, subsequent_indent=" " * pad,
                             break_on_hyphens=False) or [first.rstrip()]
    return "\n".join(out) + "\n"


def help_if_asked(tool: str, config_name: str, schema: type, doc: str | None) -> bool:
    """Print :func:`options_help` and say so when the command line asks for ``--help`` / ``-h`` (Hydra's own help
    prints the config without a word on any option)."""
    if not any(a in ("--help", "-h") for a in sys.argv[1:]):
        return False
    sys.stdout.write(options_help(tool, config_name, schema, doc))
    return True


def entry_point(app: Callable[[], Any], tool: str, config_name: str, schema: type, about: str | None
                ) -> Callable[[], Any]:
    """A console script's ``main``: ``--help`` prints :func:`options_help`; anything else runs the Hydra ``app``
    (its config errors exit 2)."""

    def main() -> Any:
        if help_if_asked(tool, config_name, schema, about):
            return 0
        return exit_2_on_config_errors(app)()

    return main
