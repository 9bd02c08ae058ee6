"""Learning at shutdown across replicas (`pbkv serve --replicas N --predictor DIR`). No Ray here.

One process trains a predictor at shutdown once `MIN_FINAL_TRAIN` (10) workflows with agent hints
have ended, and otherwise keeps nothing. With N replicas each sees only its share of the
workflows, so a session of fewer than 10 x N of them would save nothing at all. So a replica that
has too few to train on (and no trained predictor) does not drop them: its `stop` returns them
(`PolicySetup.hand_off` / `unsaved`), and once every replica has stopped the ingress pools what
they left and runs the single-process shutdown on the pool (`learn_left_over`: the same policy
set-up and the same final train and save, so the same threshold, now over all replicas' leftover
workflows together; a predictor already in DIR, saved by a replica that trained, is loaded and
its window's workflows are kept, as one process restarting would).
Invariants: a workflow a replica trained on is not handed off; the pool is trained on and saved
at most once, by the ingress, after every replica's own save; a replica the ingress could not
reach at shutdown keeps nothing (as before).
"""

from __future__ import annotations

import logging

log = logging.getLogger("pbkv.scale")


def pooled(answers: list) -> tuple[list[str], list]:
    """(save errors, the workflows left over) of the replicas' `stop` answers."""
    errors = [a["save_error"] for a in answers if isinstance(a, dict) and a.get("save_error")]
    left = [wf for a in answers if isinstance(a, dict) for wf in a.get("unsaved") or ()]
    return errors, left


def learn_left_over(cfg, block_size: int, workflows: list) -> str | None:
    """Train on `workflows` (each [(agent, context), ...]) and save to `cfg.predictor_dir`, as one
    process's shutdown would had they ended there; why that save failed, or None."""
    from pbkv.serve.learning import build_policy, finish_learning
    if not workflows or not cfg.predictor_dir:
        return None
    try:
        setup = build_policy(cfg.policy, block_size, cfg.predictor_dir, cfg.online, cfg.learn_every,
                             learn_steps=cfg.learn_steps, learn_nice=cfg.learn_nice)
    except ValueError as e:   # the folder changed since the replicas started: as a failed save
        log.error("cannot save the predictor to %s: %s", cfg.predictor_dir, e)
        return str(e)
    if setup.learner is None:
        return None
    for wf in workflows:
        setup.learner.add([agent for agent, _ in wf], [context for _, context in wf])
    saved = finish_learning(setup)
    if saved is not None:
        log.info("saved the predictor to %s (trained on %d workflows the replicas left)", saved, len(workflows))
    return setup.save_error
