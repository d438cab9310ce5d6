"""Flags, `ADLOCO_*` environment variables and `--config FILE`, one set of names for all three.

Every long option `--some-flag` of a parser can also come from the environment as
`ADLOCO_SOME_FLAG` or from a YAML config file as `some-flag: ...` (or `some_flag`). Precedence:
command-line flag > environment > config file > built-in default. Values from the environment are
text and go through the flag's own type and choices; switches take 1/0, true/false, yes/no, on/off;
list options take space-separated values. A bad value ends with a one-line message naming the
variable or the file and key, like a bad flag does.

    ADLOCO_PEERS="/ip4/10.0.0.1/tcp/31337/p2p/Qm..." ADLOCO_BATCH_SIZE=16 adloco-node
    adloco-node --config node.toml --rounds 100          # the flag beats the file's rounds
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError

ENV_PREFIX = "ADLOCO_"
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}
# Options that are not settings (they act on the settings themselves).
NOT_SETTINGS = {"help", "config"}

EPILOG = (
    "Every option can also be set as an environment variable ADLOCO_<OPTION> (e.g. --run-id as"
    " ADLOCO_RUN_ID) or in a YAML file given with --config (run-id: my-run). A flag beats the"
    " environment, which beats the file."
)


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML file of settings (keys are option names)")


def parse_settings(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse argv with defaults taken from `--config` (or ADLOCO_CONFIG) and then ADLOCO_* variables."""
    environ = os.environ if environ is None else environ
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_SETTINGS}
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    config_path = known.config or (Path(environ["ADLOCO_CONFIG"]) if environ.get("ADLOCO_CONFIG") else None)
    defaults: dict[str, Any] = {}
    if config_path is not None:
        defaults.update(_from_config(config_path, actions))
    for dest, action in actions.items():
        name = env_name(action)
        if name in environ:
            defaults[dest] = _convert(action, environ[name], where=name)
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def _from_config(path: Path, actions: Mapping[str, argparse.Action]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise UserError(f"--config: cannot read {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())
        raise UserError(f"--config: {path} is not valid YAML: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config: {path} must be a mapping of option names to values")
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise UserError(f"--config: {path}: unknown setting {key!r} (settings are the option names)")
        if value is None:
            continue
        where = f"{path}: {key}"
        if isinstance(value, list):
            if action.nargs not in ("*", "+"):
                raise UserError(f"--config: {where}: takes one value, got a list")
            values[dest] = [_convert_one(action, str(v), where=where) for v in value]
        elif isinstance(value, bool) or action.nargs in (None, "?") or isinstance(value, (int, float, str)):
            values[dest] = _convert(action, value if isinstance(value, bool) else str(value), where=where)
        else:
            raise UserError(f"--config: {where}: unsupported value {value!r}")
    return values


def _convert(action: argparse.Action, text: str | bool, *, where: str) -> Any:
    """A text (or YAML bool) value for `action`, typed and checked as the flag itself would be."""
    if action.nargs == 0:  # store_true / store_false
        if isinstance(text, bool):
            flag = text
        elif text.strip().lower() in TRUE | FALSE:
            flag = text.strip().lower() in TRUE
        else:
            raise UserError(f"{where}: expected 1/0, true/false, yes/no or on/off, got {text!r}")
        return flag if action.const is True else not flag
    if isinstance(text, bool):
        raise UserError(f"{where}: expected a value, got a true/false switch")
    if action.nargs in ("*", "+"):
        items = text.split()
        if action.nargs == "+" and not items:
            raise UserError(f"{where}: expected at least one value")
        return [_convert_one(action, item, where=where) for item in items]
    return _convert_one(action, text, where=where)


def _convert_one(action: argparse.Action, text: str, *, where: str) -> Any:
    value: Any = text
    if action.type is not None:
        try:
            value = action.type(text)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"invalid value {text!r}"
            raise UserError(f"{where}: {detail}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UserError(f"{where}: {text!r} is not one of {choices}")
    return value
