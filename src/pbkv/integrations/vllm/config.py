"""The connector's `kv_connector_extra_config`, checked once at start. Imports no vLLM.

Every key is optional; JSON null is the same as leaving the key out, except for `steer_gpu`
(null used to turn steering off: it is refused rather than silently meaning true). A value that
breaks a rule raises `ValueError` naming `kv_connector_extra_config.<key>` and the value, before
anything is built; every problem of one config is reported together. Rules:

- the config itself is a JSON object; a key that is not in `KEYS` is refused, with the known
  keys listed (a misspelt key must not silently fall back to a default);
- `policy`: a non-empty string naming a registered policy that runs live (`connector_policy`:
  not one reading the replay's future; `predictor_dir` given exactly when the policy reads a
  trained predictor), checked in the same pass as the other keys;
- `host_tokens` 0 with `disk_tokens` > 0 is refused (the disk is reached only through RAM);
- `predictor_dir`, `disk_dir`, `shared_dir`: non-empty strings naming a directory or a path that
  does not exist yet (the nearest existing ancestor must be a directory); for `disk_dir` and
  `shared_dir`, which the connector makes and writes, a folder must be creatable there now
  (tried once, then removed: a read-only folder, /proc);
- `stats_path`: a non-empty string naming a regular file or nothing yet, in an existing directory
  where a file can be made now (tried once, then removed): it is written as requests finish,
  long after start, and a write that fails then is only logged. Not a device or other special
  file: the stats replace the file (`os.replace`), so `/dev/null` would be replaced, as root;
- `device_tokens`, `host_tokens`, `disk_tokens`: integers >= 0 (0 device tokens: vLLM's whole
  pool, as in `CacheConfig.resolve`); `shared_bytes`: an integer > 0;
- `steer_gpu`: a JSON boolean;
- `agent_graph`: a JSON object, agent name -> list of the agent names that may follow it ("START"
  and "END" included, as `pbkv.policy.step_graph` reads it); `static_sequence`: a list of agent
  names. Both go to the policy's context (kvflow's static workflow graph); without them kvflow
  knows no graph and ranks blocks as LRU does.

Integers are Python `int`s but not `bool`s (JSON `true` is not 1 token); floats are refused
rather than truncated. No check converts or replaces a value: a config that passes means what
it meant before the checks, defaults included.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

PREFIX = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorConfig:
    """A checked extra config: None means "not given" (the connector's default applies)."""

    policy: str | None = None
    predictor_dir: str | None = None
    device_tokens: int | None = None
    host_tokens: int | None = None
    disk_tokens: int | None = None
    disk_dir: str | None = None
    steer_gpu: bool = True
    stats_path: str | None = None
    shared_dir: str | None = None
    shared_bytes: int | None = None
    agent_graph: dict | None = None         # agent -> its possible next agents (kvflow's static graph)
    static_sequence: list | None = None     # the workflows' fixed agent order, when they have one (kvflow)


KEYS = tuple(f.name for f in fields(ConnectorConfig))


def _text(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return "must be a non-empty string"
    return None


def _path(value: Any) -> str | None:
    problem = _text(value)
    if problem is None and "\0" in value:
        return "must not contain a NUL character"
    return problem


def _directory(value: Any) -> str | None:
    problem = _path(value)
    if problem is not None:
        return problem
    path = Path(value)   # as the connector will use it (no ~ expansion there either)
    # os.path.lexists / isdir answer False where Path.exists may raise (a folder we may not list)
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is not None and not os.path.isdir(existing):
        return f"must name a directory ({str(existing)!r} exists and is not one)"
    return None


def _writable_directory(value: Any) -> str | None:
    """A directory the connector makes and writes (`disk_dir`, `shared_dir`): as `_directory`, and
    a folder can be made now in it or in its nearest existing ancestor (tried once, then removed),
    so a read-only or pseudo file system (/proc) is refused here, not as a bare OSError later."""
    problem = _directory(value)
    if problem is not None:
        return problem
    path = Path(value)
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is None:
        existing = Path(".")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pbkv-check-", dir=existing))
    except OSError as e:
        return f"must name a directory that can be made and written ({str(existing)!r}: {e.strerror or e})"
    return None


def _file(value: Any) -> str | None:
    problem = _path(value)
    if problem is not None:
        return problem
    if os.path.isdir(value):
        return "must name a file, not a directory"
    if os.path.lexists(value) and not os.path.isfile(value):
        return "must name a regular file (the stats replace it: a device or special file would be lost)"
    parent = os.path.dirname(value) or "."
    if not os.path.isdir(parent):
        return f"must name a file in an existing directory ({parent!r} is not one)"
    try:   # can the stats be written there at all (a read-only folder, /proc, no permission)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        return f"must name a file in a directory where files can be made ({parent!r}: {e.strerror or e})"
    return None


def _count(minimum: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return f"must be an integer >= {minimum}"
        return None
    return check


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)


def _graph(value: Any) -> str | None:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k.strip() and _names(v)
                                                 for k, v in value.items()):
        return "must be a JSON object mapping each agent name to a list of the agent names that may follow it"
    return None


def _sequence(value: Any) -> str | None:
    return None if _names(value) else "must be a JSON list of agent names"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be a JSON boolean (true or false)"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "policy": _text, "predictor_dir": _directory, "device_tokens": _count(0), "host_tokens": _count(0),
    "disk_tokens": _count(0), "disk_dir": _writable_directory, "steer_gpu": _boolean, "stats_path": _file,
    "shared_dir": _writable_directory, "shared_bytes": _count(1), "agent_graph": _graph,
    "static_sequence": _sequence,
}
assert set(CHECKS) == set(KEYS)   # a new ConnectorConfig field needs its check
NULL_IS_UNSET = frozenset(KEYS) - {"steer_gpu"}


def _unknown(keys: list) -> str:
    """One message for every unknown key, each with its likely intended key, then the known keys."""
    named = []
    for key in keys:
        close = difflib.get_close_matches(str(key), KEYS, n=1)
        name = key if isinstance(key, str) and len(key) <= 80 else _show(key)
        named.append(f"{PREFIX}.{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"{', '.join(named)}: unknown key{'s' if len(keys) > 1 else ''}; known keys: {', '.join(KEYS)}"


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut to 80 characters."""
    try:
        text = repr(value)
    except ValueError:   # an int of more than 4300 digits has no repr by default
        return f"<a {type(value).__name__} too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def parse_extra(extra: Any) -> ConnectorConfig:
    """The checked `ConnectorConfig` of a raw extra config (None: all defaults); see the module
    docstring for the rules. Raises ValueError listing every problem."""
    if extra is None:
        return ConnectorConfig()
    if not isinstance(extra, Mapping):
        raise ValueError(f"pbkv connector: {PREFIX} must be a JSON object, got {_show(extra)}")
    unknown = [key for key in extra if key not in CHECKS]
    problems = [_unknown(unknown)] if unknown else []
    given, bad = {}, set()
    for key, value in extra.items():
        if key not in CHECKS or (value is None and key in NULL_IS_UNSET):
            continue   # null: unset, the default (not a bad key: the policy's checks still run)
        problem = CHECKS[key](value)
        if problem is None:
            given[key] = value
        else:
            bad.add(key)
            problems.append(f"{PREFIX}.{key}={_show(value)}: {problem}")
    config = ConnectorConfig(**given)
    # the policy's checks (`connector_policy`, run again at the scheduler's start) in the same
    # pass, so one error names every bad key, the policy's included
    problems += _policy_problems(config, frozenset(bad))
    if problems:
        raise ValueError("pbkv connector: " + "; ".join(problems))
    return config


def connector_policy(config: ConnectorConfig) -> str:
    """The policy the connector runs (`policy`, else "pbkv" with `predictor_dir`, else "lru"),
    checked at start in the extra config's own terms (ValueError naming its keys), not in the
    words of `pbkv bench`'s command line that the policies' own errors use: an unknown name, a
    policy reading the replay's future (the oracle: a live connector has none), a predicting
    policy without `predictor_dir` or a `predictor_dir` the policy does not read (it would be
    loaded and silently unused), a disk tier below a host tier of 0. `parse_extra` runs the same
    checks (`_policy_problems`), so a config it passed passes here too."""
    problems = _policy_problems(config)
    if problems:
        raise ValueError("pbkv connector: " + "; ".join(problems))
    return _policy_name(config)


def _policy_name(config: ConnectorConfig) -> str:
    return config.policy or ("pbkv" if config.predictor_dir else "lru")


def _policy_problems(config: ConnectorConfig, bad: frozenset = frozenset()) -> list[str]:
    """Every problem `connector_policy` refuses, as messages; `bad`: keys already refused by their
    own check (left out of `config`), whose cross-checks are skipped (they would only repeat them).
    Needs nothing but the config (no vLLM object), so `parse_extra` reports it with the rest."""
    from pbkv.policy.registry import UnknownPolicy, needed_predictor, needs_future, predicting_policies
    problems = []
    if "policy" not in bad and "predictor_dir" not in bad:
        policy = _policy_name(config)
        try:
            future, variant = needs_future(policy), needed_predictor(policy)
        except UnknownPolicy as e:
            problems.append(f"{PREFIX}.policy={_show(policy)}: {e}")
        else:
            if future:
                problems.append(f"{PREFIX}.policy={_show(policy)} reads the replayed trace's future, "
                                f"which a live connector never has; give a policy that runs on what it has seen "
                                f"(lru, pbkv-retired, kvflow, or pbkv with {PREFIX}.predictor_dir)")
            elif variant is not None and not config.predictor_dir:
                problems.append(f"{PREFIX}.policy={_show(policy)} needs a trained {variant} predictor: "
                                f"give {PREFIX}.predictor_dir (a folder saved by `pbkv train`)")
            elif variant is None and config.predictor_dir:
                problems.append(f"{PREFIX}.predictor_dir={_show(config.predictor_dir)} given, but "
                                f"{PREFIX}.policy={_show(policy)} reads no trained predictor (policies that do: "
                                f"{', '.join(predicting_policies())}); leave predictor_dir out")
    if "host_tokens" not in bad and "disk_tokens" not in bad and config.host_tokens == 0 and config.disk_tokens:
        problems.append(f"{PREFIX}.disk_tokens={config.disk_tokens} with {PREFIX}.host_tokens=0: "
                        f"blocks reach the disk tier only through the host (RAM) tier, so the disk would never "
                        f"be used; give host_tokens > 0, or disk_tokens 0 (or leave it out)")
    return problems
