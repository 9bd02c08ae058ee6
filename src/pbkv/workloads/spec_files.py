"""Spec files: load a workflow spec from a built-in name, a YAML or JSON file, or a dict.

Every problem becomes one `SpecError` whose lines read "FILE: field.path[i].name: what is wrong
(got VALUE)" (a YAML or JSON syntax error: "FILE:LINE: ..."); a repeated key (YAML or JSON) is an
error, not silently the last one. Data nested more than MAX_NESTING levels, or with more than
MAX_NODES values once YAML aliases are expanded, is refused before it is validated, so no check
recurses or loops without bound. What a valid spec is: `spec.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import ValidationError

from pbkv import unique_json
from pbkv.files import is_text, read_text
from pbkv.workloads.expr import show
from pbkv.workloads.spec import WorkflowSpec

BUILTIN_DIR = Path(__file__).parent / "builtin"
SUFFIXES = (".yaml", ".yml", ".json")
MAX_NESTING = 32  # levels of lists and mappings; a spec needs 7 (task.vars.NAME.words.VALUE[i])
# values (keys included) of a spec, counted with YAML aliases expanded: a 0.5 KB "billion laughs" file
# expands to 9**9 strings, which validating or showing in an error would take gigabytes to go through
MAX_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class SpecError(ValueError):
    """A spec file or dict is invalid; the message names the file, the field path and the value."""


def builtin_names() -> list[str]:
    """Names of the built-in specs (`builtin/*.yaml`)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def _where(err: dict) -> str:
    """Where a pydantic error is: `agents.a.sees[0]`; a wrong mapping key (loc `(..., key, '[key]')`,
    the key itself the input) as `agents: key 1`, not as a list index or a field."""
    loc = err["loc"]
    if len(loc) >= 2 and loc[-1] == "[key]":  # pydantic writes a None key as 'None': show the input
        return f"{_path(loc[:-2])}: key {show(err['input'])}"
    return _path(loc)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _format(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # cross-reference errors: already "path: message" lines
            lines += [f"{source}: {m}" for m in msg.splitlines()]
        elif e["type"] == "missing":
            lines.append(f"{source}: {_path(e['loc'])}: required field is missing")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{source}: {_path(e['loc'])}: unknown field (check the spelling)")
        else:
            lines.append(f"{source}: {_where(e)}: {msg} (got {show(e['input'])})")
    return "\n".join(lines)


def _nodes(data: Any) -> Iterator[tuple[tuple, Any, bool]]:
    """(path, value, is_key) of every value and mapping key in `data`, in file order, without
    recursion; a key's path is its mapping's, a value's is its mapping's plus its key (or index)."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, v = stack.pop()
        yield path, v, False
        if isinstance(v, dict):
            for k in v:
                yield path, k, True
            stack.extend(((*path, k), x) for k, x in reversed(v.items()))  # popped in file order
        elif isinstance(v, list):
            stack.extend(((*path, i), x) for i, x in reversed(list(enumerate(v))))


def _check_tree(data: Any, source: str):
    """Refuse data no valid spec looks like, before validating it: nested more than MAX_NESTING
    levels, more than MAX_NODES values (aliases counted each time they are used), or a string
    that is not valid Unicode text (a lone surrogate, which JSON's \\ud800 escape can give: the
    trace it would be written to could not be read back)."""
    for n, (path, v, is_key) in enumerate(_nodes(data)):
        if len(path) > MAX_NESTING:
            raise SpecError(_too_deep(source))
        if n >= MAX_NODES:
            raise SpecError(f"{source}: more than {MAX_NODES:,} values (YAML aliases count once per use)")
        if isinstance(v, str) and not is_text(v):
            what = f"the name {show(v)}" if is_key else show(v)
            raise SpecError(f"{source}: {_path(path) or 'top level'}: {what} holds a lone surrogate "
                            f"(not valid Unicode text)")


def _too_deep(source: str) -> str:
    return f"{source}: nested too deeply (more than {MAX_NESTING} levels)"


def parse_spec(data: Any, source: str = "<spec>") -> WorkflowSpec:
    """Validate a dict (parsed YAML/JSON) into a `WorkflowSpec`; errors name `source` and field paths."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    _check_tree(data, source)
    try:
        return WorkflowSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_format(source, e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a repeated key (plain YAML keeps the last one silently). Merge keys
    (`<<: *base`) read as `yaml.safe_load` reads them: a key written in the mapping may override
    a merged one, but not another key written in the mapping."""

    def construct_mapping(self, node, deep=False):
        own = sum(key_node.tag != _MERGE_TAG for key_node, _ in node.value)
        self.flatten_mapping(node)  # merged pairs first, then the mapping's own ones
        seen = set()
        for key_node, _ in node.value[len(node.value) - own:]:
            key = self.construct_object(key_node, deep=deep)
            if not _hashable(key):  # as yaml.safe_load says it, not a TypeError from `in seen`
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        "found unhashable key", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse(raw: str, is_json: bool) -> Any:
    """Parsed spec text; a repeated key is an error in both formats."""
    return unique_json.loads(raw) if is_json else yaml.load(raw, Loader=_UniqueKeyLoader)


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def spec_source(name_or_path: str | Path) -> str:
    """How errors name the spec `load_spec(name_or_path)` reads: `hover.yaml` for a built-in, else
    the path as given."""
    text = str(name_or_path)
    return f"{text}.yaml" if isinstance(name_or_path, str) and text in builtin_names() else text


def load_spec(name_or_path: str | Path) -> WorkflowSpec:
    """Load a built-in spec by name (`hover`) or a spec file (.yaml, .yml or .json)."""
    text, source = str(name_or_path), spec_source(name_or_path)
    if isinstance(name_or_path, str) and text in builtin_names():
        path = BUILTIN_DIR / source
    else:
        path = Path(name_or_path)
        if path.suffix.lower() not in SUFFIXES:
            raise SpecError(f"{text}: not a built-in workload ({', '.join(builtin_names())}) "
                            f"and not a {'/'.join(SUFFIXES)} file")
        if path.is_dir():
            raise SpecError(f"{text}: is a folder, not a spec file")
        if not path.exists():
            raise SpecError(f"{text}: no such spec file")
        if not path.is_file():   # a FIFO or device: reading it could block or never end
            raise SpecError(f"{text}: not a regular file")
    return parse_spec(_read(read_text(path, source, SpecError), path.suffix.lower() == ".json", source), source)


def _read(raw: str, is_json: bool, source: str) -> Any:
    """Parsed spec text; every failure is a SpecError naming `source` (and the line where known)."""
    kind = "JSON" if is_json else "YAML"
    if is_json:
        raw = raw.removeprefix("\ufeff")  # a byte-order mark, as editors write it: YAML's reader skips it
    try:
        return _parse(raw, is_json)
    except json.JSONDecodeError as e:
        raise SpecError(f"{source}:{e.lineno}: not valid JSON: {e.msg}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise SpecError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise SpecError(_too_deep(source)) from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise SpecError(f"{source}: not valid {kind}: {str(e)[:200]}") from None
