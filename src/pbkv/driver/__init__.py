"""Runs workflows against an engine (closed-loop lanes or open-loop arrivals) and records them."""

from pbkv.driver.metrics import Recorder, percentile
from pbkv.driver.replay import Replay

__all__ = ["Replay", "Recorder", "percentile"]
