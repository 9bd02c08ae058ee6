"""Synthetic workflow workloads: one spec language (YAML/JSON), seeded generators, four built-ins.

    spec = load_spec("hover")            # or a path to your own .yaml / .json spec
    trace = generate(spec, workflows=1000, seed=0)

Built-ins (`builtin_names()`): hover (LangChain multi-hop claim verification), swe (AutoGen coding
agent), finance (CrewAI static pipeline), dialogue (routed multi-turn support chat).
"""

from pbkv.workloads.expr import Expr, ExprError, compile_expr
from pbkv.workloads.generate import Run, generate, runs
from pbkv.workloads.spec import WorkflowSpec
from pbkv.workloads.spec_files import SpecError, builtin_names, load_spec, parse_spec

__all__ = ["WorkflowSpec", "load_spec", "parse_spec", "builtin_names", "generate", "runs", "Run",
           "SpecError", "Expr", "ExprError", "compile_expr"]
