"""nanoGPT-style configuration: a script's defaults, then config files (plain Python assignments), then
--key=value overrides, each checked against the declared type (settings.py declares the keys)."""
import ast
import dataclasses
import difflib
import os
import sys
import types
from pathlib import Path

from env import GENERATED_CONFIG, REPO  # REPO: where config/ lies, named when a relative path is not found
from results import atomic_write_text


class ConfigError(ValueError):
    """A user mistake in a config file or a --key=value override."""


# Keys that were renamed: the old name is refused with the new one, never silently ignored.
RENAMED_KEYS = {"sdpa_backend": "attention_backend"}


def _parse_value(key, text, default, kind):
    if kind is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--{key}={text}: expected a boolean (True or False)")
    if kind is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--{key}={text}: expected {kind.__name__}, like the default {default!r}") from None
    return _check_type(key, value, default, kind, f"--{key}={text}")


def _check_type(key, value, default, kind, where):
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise ConfigError(f"{where}: {key} must be {kind.__name__} (like the default {default!r}), "
                          f"got {type(value).__name__} {value!r}")
    return value


# nanoGPT's keys whose closest spelling here is not what they mean (max_iters is closest to eval_interval): the
# keys that do their job here, and how, for a script that has those keys.
NANOGPT_KEYS = {
    "max_iters": (("epochs", "stop_after_updates"), "a run is `epochs` passes over train_subset_tokens; "
                  "stop_after_updates=N stops it after N updates, checkpointed (--resume=True goes on)"),
    "lr_decay_iters": (("lr_schedule", "cooldown_fraction"), "the schedule spans the whole run (its epochs); "
                       "lr_schedule and cooldown_fraction set its shape"),
    "batch_size": (("micro_batch_size", "tokens_per_update"), "micro_batch_size is the sequences of one "
                   "micro-step; tokens_per_update sets an update's size"),
    "gradient_accumulation_steps": (("tokens_per_update", "micro_batch_size"), "the micro-steps follow from "
                                    "tokens_per_update / (micro_batch_size x seq_len)"),
    "block_size": (("seq_len",), "the context length is seq_len"),
    "n_embd": (("dim",), "the model's width is dim"),
    "eval_iters": (("val_subset_tokens",), "the validation subset is val_subset_tokens tokens"),
}


def _unknown_key(key, defaults, where):
    from model import REMOVED_LEVERS, removed_lever  # not at the top: only this error needs model.py (and torch)
    if key in REMOVED_LEVERS:
        return ConfigError(f"{where}: {removed_lever(key)}; leave the key out (the run is then the lever off)")
    if RENAMED_KEYS.get(key) in defaults:
        return ConfigError(f"{where}: config key {key!r} is now called {RENAMED_KEYS[key]!r}; use "
                           f"{RENAMED_KEYS[key]} = ... (or --{RENAMED_KEYS[key]}=...) with the same values")
    keys, how = NANOGPT_KEYS.get(key, ((None,), ""))
    if all(k in defaults for k in keys):
        return ConfigError(f"{where}: unknown config key {key!r} (nanoGPT's); here {how}")
    close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
    hint = f"closest valid keys: {', '.join(close)}" if close else "--help lists every key"
    return ConfigError(f"{where}: unknown config key {key!r}; {hint}")


def _declared(settings):
    """(defaults, types, help) of a settings class (settings.py), or of a plain dict of defaults."""
    if isinstance(settings, dict):
        return dict(settings), {k: type(v) for k, v in settings.items()}, {}
    found = dataclasses.fields(settings)
    return ({f.name: f.default for f in found}, {f.name: f.type for f in found},
            {f.name: f.metadata for f in found})


def print_usage(settings):
    """--help: the running script's docstring, then its keys group by group (a composed settings class, settings.py,
    names its groups): default, help, choices."""
    import __main__
    defaults, _, meta = _declared(settings)
    print((__main__.__doc__ or "").strip() + "\n\nsettings (config files assign them; --key=value overrides):")
    groups = [(g.__doc__ or "").strip().splitlines()[0] for g in getattr(settings, "groups", ())]
    keys_of = [[f.name for f in dataclasses.fields(g)] for g in getattr(settings, "groups", ())]
    listed = {k for keys in keys_of for k in keys}
    rest = [k for k in defaults if k not in listed]
    for title, keys in zip(groups + ["other"], keys_of + [rest]):
        if keys:
            print(f"\n{title}:")
        for key in keys:
            m = meta.get(key) or {}
            extra = f" [{' | '.join(m['choices'])}]" if m.get("choices") else ""
            print(f"  {f'--{key}={defaults[key]!r}':<34} {m.get('help', '')}{extra}")


def missing_config_file(arg):
    """The error for a config file argument that is no file: a folder, or a path not found from the current
    folder (which relative paths are taken from, also when the script is run from elsewhere)."""
    path = Path(arg)
    if path.is_dir():
        return ConfigError(f"config file {arg!r} is a folder; pass a file such as config/tiny_cpu.py, or overrides "
                           f"as --key=value")
    in_repo = "" if path.is_absolute() or not (REPO / path).is_file() else \
        f" (relative paths are taken from the current folder {os.getcwd()}; the repository has it at {REPO / path})"
    return ConfigError(f"config file {arg!r} does not exist{in_repo}; pass a file such as config/tiny_cpu.py or "
                       f"overrides as --key=value")


def load_config(settings, argv, file_keys=None):
    """nanoGPT-style configuration: defaults <- config files (plain assignments) <- --key=value overrides.

    settings: a settings class (settings.py), or a dict of defaults whose values give the types (compare.py
    layers a config over another this way). argv holds config file paths and overrides in order; overrides are
    `--key=value` or `--key value`. Every key must be declared and keep its type. file_keys (a settings class):
    keys a config file may also assign, type-checked and then left out (a config file is a recipe, which a script
    that reads a few of its keys still takes). Returns a new dict.
    """
    defaults, kinds, _ = _declared(settings)
    also, also_kinds, _ = _declared(file_keys) if file_keys is not None else ({}, {}, {})
    config = dict(defaults)
    args = list(argv)
    if "-h" in args or "--help" in args:
        try:
            print_usage(settings)
            sys.stdout.flush()
        except BrokenPipeError:
            # the reader stopped early (`--help | head`): no traceback, and none at exit when Python flushes again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            key, value = _override(arg, args, defaults, kinds, also)
            config[key] = value
        else:
            config.update(_config_file(arg, config, defaults, kinds, also, also_kinds))
    return config


def _override(arg, args, defaults, kinds, also):
    """(key, value) of one `--key=value`, `--key value` or bare boolean `--flag`, taking the value from args."""
    key, eq, text = arg[2:].partition("=")
    key = key.replace("-", "_")
    if key not in defaults:
        if key in also:
            raise ConfigError(f"--{key} is a key this script does not use (config files may set it, for "
                              f"train.py); --help lists this script's keys")
        raise _unknown_key(key, defaults, f"--{key}")
    if not eq:  # --key value, or a bare --flag for a boolean
        takes_next = args and not args[0].startswith("--")
        if takes_next and kinds[key] is bool:
            takes_next = args[0].strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off")
        if takes_next:
            text = args.pop(0)
        elif kinds[key] is bool:
            text = "True"
        else:
            raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
    return key, _parse_value(key, text, defaults[key], kinds[key])


def argv_value(argv, key, kind, default):
    """The value argv's overrides give key (the last of them), else default, read as load_config reads them, without
    the settings (whose module imports torch): for what a script does before it imports anything. A value that does
    not parse gives default; the script's own load_config reports it."""
    value, args = default, list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--") and arg[2:].partition("=")[0].replace("-", "_") == key:
            try:
                value = _override(arg, args, {key: default}, {key: kind}, {})[1]
            except ConfigError:
                return default
    return value


def _config_file(arg, config, defaults, kinds, also, also_kinds):
    """The settings a config file assigns, checked, run over the settings so far (config)."""
    path = Path(arg)
    if not path.is_file():
        raise missing_config_file(arg)
    # One namespace holding the settings so far, as nanoGPT's configurator runs a file in the script's
    # globals: `tokens_per_update = seq_len * 32` sees the default seq_len, and a comprehension or
    # function in the file sees the names assigned above it (with separate locals it did not).
    # __file__ is the file's own path, so that a recipe can build on another beside it (config/20m_quality.py)
    namespace = dict(also, **config, __file__=str(path))
    try:  # its bytes, as Python runs a file: a UTF-8 BOM (Windows editors) or a coding line is understood
        exec(compile(path.read_bytes(), str(path), "exec"), namespace)
    except SystemExit as exc:  # sys.exit() in a config file would end the script silently, having done nothing
        raise ConfigError(f"config file {arg} called exit({'' if exc.code is None else repr(exc.code)}); a "
                          f"config file assigns settings and ends by itself") from None
    except Exception as exc:  # a config file is user input: report, don't trace back
        raise ConfigError(f"config file {arg} could not be run: {type(exc).__name__}: {exc}") from None
    assigned = {}
    for key, value in namespace.items():
        if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type,
                                                     types.BuiltinFunctionType)):
            continue  # `import math`, `from math import sqrt`, a helper function: not settings
        if key not in defaults and key in also:
            _check_type(key, value, also[key], also_kinds[key], f"config file {arg}")
            continue
        if key not in defaults:
            raise _unknown_key(key, defaults, f"config file {arg}")
        assigned[key] = _check_type(key, value, defaults[key], kinds[key], f"config file {arg}")
    return assigned


def write_config_file(path, config, defaults, header="", keep=()):
    """Write the keys of `config` that differ from `defaults`, and those named in `keep` whatever their value, as a
    config file that reproduces it (keep: keys that must hold when the file is layered over another config)."""
    lines = [GENERATED_CONFIG.decode()] + [f"# {line}" for line in header.splitlines()]
    lines += [f"{k} = {v!r}" for k, v in config.items() if k in defaults and (v != defaults[k] or k in keep)]
    atomic_write_text(path, "\n".join(lines) + "\n")
