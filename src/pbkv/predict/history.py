"""The workflows a served predictor learned from, kept beside it so learning survives a restart.

A server that learns online (`pbkv serve --predictor DIR`) saves, with each predictor version,
the agents and contexts of the workflows in its learning window (`workflows.json`); the next
server on DIR starts its window with them, so its retrains learn from every session's traffic,
not from its own alone. A predictor saved by `pbkv train` into a new folder has no such file (its
traces are the user's) and starts with an empty window; into a folder servers saved into, its
version carries the live version's workflows (`cli.predict._save_keeping_history`).

Invariants:
- the file is part of the version it was saved with: read from the live version only, so it
  always belongs to the predictor loaded beside it;
- a context is kept to its first `MAX_CONTEXT_CHARS` characters: the featurizer reads no more
  (`FeatureConfig.max_chars`, the default a server's retrains use), so the cut loses nothing the
  predictor can learn from;
- several servers on one folder lose no workflows to each other: a save writes the live
  version's workflows (another server's included, saved since this one started) followed by
  those of its own window the folder does not hold yet (`merge_with_live`; the server tracks
  which, by workflow, not by content: two servers' workflows may look alike), newest `window` in
  all. The predictor saved is this server's; the next server trains on everyone's traffic.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pbkv.files import is_text, read_text
from pbkv.predict import store
from pbkv.predict.features import FeatureConfig
from pbkv.trace.io import show_value

FILE = "workflows.json"
FORMAT = "pbkv-workflows"
MAX_CONTEXT_CHARS = FeatureConfig.max_chars

Workflow = list[tuple[str, "str | None"]]   # (agent, context) per call, in call order
log = logging.getLogger("pbkv.predict")


def write_history(folder: Path, workflows: list[Workflow]) -> None:
    """Write `workflows` into a version folder being saved (`store.publish`'s `write`)."""
    rows = [[[agent, None if ctx is None else ctx[:MAX_CONTEXT_CHARS]] for agent, ctx in wf] for wf in workflows]
    (folder / FILE).write_text(json.dumps({"format": FORMAT, "workflows": rows}) + "\n", encoding="utf-8")


def merge_with_live(path: str | Path, ours: list[Workflow], window: int) -> list[Workflow]:
    """The live version's workflows followed by `ours` (oldest first: workflows the folder does
    not hold yet), the newest `window` kept. Called under the save lock (`store.publish`), so no
    other save lands between this read and the write. An unreadable live history is logged and
    left out: it cannot be carried over anyway."""
    try:
        live = read_history(path)
    except (OSError, ValueError) as e:
        log.warning("the workflows saved in %s are not carried over: %s", path, e)
        live = []
    return (live + list(ours))[-window:] if window > 0 else []


def read_history(path: str | Path) -> list[Workflow]:
    """The workflows saved with the live version of predictor directory `path` ([] when none).
    Raises ValueError naming the file (and the entry) for anything but a readable
    pbkv-workflows file of valid entries: also for JSON nested too deeply, a lone surrogate in a
    string (valid JSON, but no text: a retrain on it fails at the shutdown save) and a
    `workflows.json` that is not a file."""
    file = store.live_dir(path) / FILE
    if not os.path.lexists(file):
        return []
    if not file.is_file():   # a folder is no "no history"; a FIFO would block the read
        raise ValueError(f"{file}: not a file")
    text = read_text(file)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{file}: not JSON (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("workflows"), list):
        raise ValueError(f"{file}: not a {FORMAT} file")
    return [_workflow(file, i, wf) for i, wf in enumerate(data["workflows"])]


def _workflow(file: Path, index: int, rows) -> Workflow:
    if not (isinstance(rows, list) and rows and all(_is_call(r) for r in rows)):
        raise ValueError(f"{file}: workflows.{index}: expected a non-empty list of [agent, context or null], "
                         f"got {show_value(rows)}")
    bad = next((s for row in rows for s in row if s is not None and not is_text(s)), None)
    if bad is not None:
        raise ValueError(f"{file}: workflows.{index}: a string holds a lone surrogate (not valid Unicode "
                         f"text), got {show_value(bad[:40])}")
    return [(agent, ctx) for agent, ctx in rows]


def _is_call(row) -> bool:
    return (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and row[0] != ""
            and (row[1] is None or isinstance(row[1], str)))

