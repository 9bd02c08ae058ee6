"""`pbkv perf sim|policy|evict`: speed figures of the simulator, the policies and the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pbkv.cli.common import (ConcurrencyOpt, DeviceTokensOpt, HostTokensOpt, PolicyOpt, PredictorOpt, WorkflowsOpt,
                             WorkloadOpt, check_exist, console, exit_on_error, fail, one_concurrency)

perf_app = typer.Typer(no_args_is_help=True, help="Speed figures of the simulator, the policies and the cache.")


@perf_app.command("sim")
def perf_sim(
    workload: WorkloadOpt = "hover",
    workflows: WorkflowsOpt = 2000,
    concurrency: ConcurrencyOpt = "64",
    policy: PolicyOpt = "lru",
    predictor: PredictorOpt = None,
):
    """Calls simulated per minute (target >= 100,000)."""
    from pbkv.bench.perf import sim_speed
    lanes = one_concurrency(concurrency)
    model = predictor_arg(policy, predictor)
    with exit_on_error():
        r = sim_speed(workload, workflows, lanes, policy, model, note=print_note)
    console.print(f"{r['calls']} calls in {r['seconds']:.2f} s: {r['calls_per_minute']:,.0f} calls simulated per minute "
                  f"({workload}, {policy}, concurrency {concurrency}; generation not counted)",
                  markup=False)  # a spec file's path is text, not rich markup


@perf_app.command("policy")
def perf_policy(
    workload: WorkloadOpt = "hover",
    policy: PolicyOpt = "pbkv",
    predictor: PredictorOpt = None,
    workflows: WorkflowsOpt = 600,
    concurrency: ConcurrencyOpt = "160",
    device_tokens: DeviceTokensOpt = None,
    host_tokens: HostTokensOpt = 0,
):
    """Wall time of policy decisions vs simulated run time (target <= 5%); predictions made live."""
    from pbkv.bench.perf import policy_overhead
    from pbkv.cache import CacheConfig
    lanes = one_concurrency(concurrency)
    model = predictor_arg(policy, predictor)
    with exit_on_error():
        r = policy_overhead(workload, policy, model, workflows, lanes,
                            CacheConfig(device_tokens, host_tokens), note=print_note)
    console.print(f"{policy} on {workload} (concurrency {concurrency}): {r['policy_seconds']:.2f} s of policy decisions "
                  f"for {r['calls']} calls ({r['us_per_call']:.0f} us per call) in a simulated run of "
                  f"{r['makespan_s']:,.0f} s: {r['overhead'] * 100:.3f}% added", markup=False)


@perf_app.command("evict")
def perf_evict(
    nodes: Annotated[int, typer.Option(min=1100, max=10_000_000, help="Nodes in the tree.")] = 100_000,
    policy: PolicyOpt = "lru",
    predictor: PredictorOpt = None,
):
    """Eviction cost per evicted node in a tree of NODES nodes with live workflows (target <= 50 us).
    Predicting policies use a Markov predictor fitted on the synthetic workflows (agents a0..a4);
    --predictor DIR only with a predictor that knows those agents (one trained elsewhere would
    predict every call as the unknown agent: refused)."""
    from pbkv.bench.perf import evict_speed
    model = predictor_arg(policy, predictor)
    with exit_on_error():
        r = evict_speed(nodes, policy, model=model)
    used = f"; predictor: {r['predictor']}" if r["predictor"] else ""
    load = f"; load average {r['load']:.1f}" if r["load"] is not None else ""
    console.print(f"{r['evicted']} nodes evicted from a full {r['nodes']:,}-node tree with live workflows in "
                  f"{r['seconds'] * 1e3:.1f} ms of CPU time: {r['us_per_node']:.1f} us per evicted node "
                  f"({policy}{used}{load})", markup=False)  # a predictor folder's path is text


def predictor_arg(policy: str, predictor: Path | None) -> str | None:
    """--predictor as perf's functions take it, checked before any work (exit 2): the policy is
    known, the path exists (as bench checks it), and the policy reads a trained predictor (else
    the figure would be taken without it while the command line names one)."""
    from pbkv.policy.registry import needed_predictor, predicting_policies
    with exit_on_error():
        variant = needed_predictor(policy)
    if predictor is None:
        return None
    check_exist(predictor)
    if variant is None:
        fail(f"--predictor: {policy} reads no trained predictor (policies that do: {', '.join(predicting_policies())}); "
             f"leave --predictor out")
    return str(predictor)



def print_note(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)   # one line: grep finds it whole
