"""A tiny, safe expression language for transition probabilities in workflow specs.

An expression is parsed once with `ast`, checked against a whitelist, and turned into a tree of
Python closures; evaluating it is then a few function calls (no `eval`/`exec`, no attribute access
on arbitrary objects, no imports, no loops).

Allowed: numbers, strings, booleans; names given by the caller; `ns.key` and `ns['key']` on the
caller's dict namespaces (`visits['Name With Space']`, `visits[last]`); comparisons (chained too,
and `in` / `not in`); `and`, `or`, `not`; `+ - * /` and unary minus; `min(...)`, `max(...)`;
`a if cond else b`; list/tuple literals (for `in`).

Invariants of a compiled `Expr`:
- every name it reads exists in the namespaces it was compiled for, and every constant key of a
  namespace with known keys is one of those keys (checked at compile time, not at run time);
- a comparison of `ns.key` (or a scalar) with a constant uses a constant from that reference's
  allowed values, when the caller provides them (catches typos such as `task.evidence == 'nosiy'`);
- evaluating it never mutates the environment;
- a string or list it builds with `+` or `*` has at most MAX_ITEMS items, the items of nested lists
  counted too (so comparing, hashing or `min` over it stays bounded): a larger one is refused
  before it is built (when the operands are constants, already at compile time).
Values shown in error messages are cut to SHOW_WIDTH characters (`show`).
An expression has at most MAX_SOURCE characters and MAX_DEPTH levels of nesting, so parsing,
checking and evaluating it never run out of stack or memory (a longer or deeper one is an ExprError).
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Collection, Iterator, Mapping

FUNCTIONS: dict[str, Callable] = {"min": min, "max": max}

_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
# A probability needs no long string or list, and `[1] * 100000000` would take seconds and gigabytes
# to build (and its repr would flood the error message that rejects it).
MAX_ITEMS = 1000
SHOW_WIDTH = 60
MAX_SOURCE = 1000  # characters of an expression; real ones are a line
MAX_DEPTH = 100  # levels of its syntax tree (`0.1+0.1+...` nests one level per `+`)
_SEQUENCES = (str, tuple)  # what an expression can build: strings, and lists (evaluated as tuples)

Env = Mapping[str, object]
Fn = Callable[[Env], object]


class ExprError(ValueError):
    """An expression is malformed, uses something outside the whitelist, or failed at run time."""


def show(v: object, width: int = SHOW_WIDTH) -> str:
    """`repr(v)`, cut to `width` characters (ending in '...') so an error message stays one line.

    Builds little more than `width` characters however large `v` is (a list of aliases of lists,
    as a YAML "billion laughs" gives, would have a repr of gigabytes)."""
    text = ""
    for piece in _repr_pieces(v, width):
        text += piece
        if len(text) > width:
            return text[:width - 3] + "..."
    return text


def _repr_pieces(v: object, width: int) -> Iterator[str]:
    """`repr(v)` in pieces, lazily: lists, tuples and dicts item by item, a long string cut."""
    kind = type(v)
    if kind is str and len(v) > width:
        yield repr(v[:width])[:-1]  # no closing quote: the text goes on
    elif kind in (list, tuple, dict) and v:
        yield "[" if kind is list else "(" if kind is tuple else "{"
        for i, item in enumerate(v.items() if kind is dict else v):
            yield ", " if i else ""
            if kind is dict:
                yield from _repr_pieces(item[0], width)
                yield ": "
                item = item[1]
            yield from _repr_pieces(item, width)
        yield "]" if kind is list else "}" if kind is dict else ",)" if len(v) == 1 else ")"
    else:
        yield repr(v)


def _size(v: object) -> int:
    """The items `v` holds at every level: a string's characters; a list's items plus the size of
    each item that is itself a list (`((1, 2), 3)`: its 2 items + the 2 of `(1, 2)` = 4; `(('',),)`
    counts 2, so a list of empty lists is no loophole). A scalar holds none.

    Walks only what an expression built, which this bound keeps small (a list literal holds at
    most what its source text spells, each `+`/`*` result at most MAX_ITEMS)."""
    if isinstance(v, str):
        return len(v)
    if isinstance(v, tuple):
        return len(v) + sum(_size(x) for x in v if isinstance(x, tuple))
    return 0


def _built_length(op: Callable, a: object, b: object) -> int | None:
    """How many items `op(a, b)` would build, nested lists counted in full (`_size`): + or * on
    strings or lists; None for anything else. Counting only the top level let `[[[1] * 1000] * 1000]
    * 1000` pass as 1000 items while comparing or hashing it walks 1e9."""
    if op is operator.add and isinstance(a, _SEQUENCES) and type(a) is type(b):
        return _size(a) + _size(b)
    if op is operator.mul and isinstance(a, _SEQUENCES) and isinstance(b, int):
        return _size(a) * max(b, 0)
    if op is operator.mul and isinstance(b, _SEQUENCES) and isinstance(a, int):
        return _size(b) * max(a, 0)
    return None


def _call_it(name: str) -> str:
    """The error for a function used as a value (`min`, `min.real`, `max['x']`)."""
    return f"'{name}' is a function: call it, e.g. {name}(a, b)"


class Expr:
    """A compiled expression: call it with an environment dict (namespace name -> dict or scalar)."""

    __slots__ = ("source", "_fn")

    def __init__(self, source: str, fn: Fn):
        self.source, self._fn = source, fn

    def __call__(self, env: Env) -> object:
        try:
            return self._fn(env)
        except ExprError:
            raise
        except Exception as e:  # e.g. division by zero, comparing None with a number
            raise ExprError(f"evaluating {self.source!r} failed: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return f"Expr({self.source!r})"


def compile_expr(source: str, dicts: Mapping[str, Collection[str] | None], scalars: Collection[str] = (),
                 choices: Mapping[str, Collection] | None = None, dict_default: Mapping[str, object] | None = None
                 ) -> Expr:
    """Parse and check `source`; return a fast evaluator.

    dicts: namespace name -> its allowed keys (None: any key). `scalars`: plain names (e.g. `step`).
    choices: reference ('task.hops', 'last') -> the constants it may be compared with.
    dict_default: namespace -> value for a key missing at run time with a computed subscript
    (e.g. `visits[last]` -> 0); other namespaces raise on a missing key.
    """
    tree = _parse(source)
    builder = _Builder(dicts, set(scalars), choices or {}, dict_default or {})
    return Expr(source, builder.build(tree.body))


def _parse(source: object) -> ast.Expression:
    """The checked syntax tree of `source`: a non-empty string of at most MAX_SOURCE characters
    whose tree is at most MAX_DEPTH levels deep."""
    if not isinstance(source, str) or not source.strip():
        raise ExprError("empty expression")
    text = source.strip()
    if len(text) > MAX_SOURCE:
        raise ExprError(f"an expression of {len(text):,} characters (at most {MAX_SOURCE})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExprError(f"syntax error at column {e.offset or 0}: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ExprError(f"nested too deeply (at most {MAX_DEPTH} levels)") from None
    if _depth(tree.body) > MAX_DEPTH:
        raise ExprError(f"nested too deeply (at most {MAX_DEPTH} levels)")
    return tree


def _depth(root: ast.AST) -> int:
    """Levels of the tree under `root` (1 for a leaf), counted without recursion."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


class _Builder:
    def __init__(self, dicts, scalars, choices, dict_default):
        self.dicts, self.scalars, self.choices, self.dict_default = dicts, scalars, choices, dict_default

    def fail(self, node: ast.AST, msg: str):
        raise ExprError(f"at column {getattr(node, 'col_offset', 0) + 1}: {msg}")

    def allowed_names(self) -> str:
        return ", ".join([*self.dicts, *sorted(self.scalars), *FUNCTIONS])

    def build(self, node: ast.AST) -> Fn:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            self.fail(node, f"{type(node).__name__} is not allowed (allowed: numbers, strings, booleans, "
                            f"names, comparisons, and/or/not, + - * /, min, max, a if c else b)")
        return method(node)

    # ---- leaves
    def _Constant(self, node: ast.Constant) -> Fn:
        v = node.value
        if not isinstance(v, (bool, int, float, str)):
            self.fail(node, f"constant {show(v)} is not allowed")
        return lambda env: v

    def _Name(self, node: ast.Name) -> Fn:
        name = node.id
        if name in self.scalars:
            return lambda env: env[name]
        if name in self.dicts:
            self.fail(node, f"'{name}' is a namespace: use {name}.NAME or {name}['NAME']")
        if name in FUNCTIONS:
            self.fail(node, _call_it(name))
        self.fail(node, f"unknown name '{name}' (allowed: {self.allowed_names()})")

    def _namespace(self, node: ast.AST) -> str:
        if isinstance(node, ast.Name) and node.id in FUNCTIONS and node.id not in self.dicts:
            self.fail(node, _call_it(node.id))  # `min.real`: min is no unknown name, it is a function
        if isinstance(node, ast.Name) and node.id not in self.dicts and node.id not in self.scalars:
            self.fail(node, f"unknown name '{node.id}' (allowed: {self.allowed_names()})")
        if not isinstance(node, ast.Name) or node.id not in self.dicts:
            self.fail(node, f"only the namespaces {', '.join(self.dicts)} can be indexed "
                            f"(got {show(ast.unparse(node))})")
        return node.id

    def _key(self, node: ast.AST, ns: str, key: str) -> Fn:
        known = self.dicts[ns]
        if known is not None and key not in known:
            self.fail(node, f"unknown {ns} key '{key}' (known: {', '.join(known) or 'none'})")
        return lambda env: env[ns][key]

    def _Attribute(self, node: ast.Attribute) -> Fn:
        return self._key(node, self._namespace(node.value), node.attr)

    def _Subscript(self, node: ast.Subscript) -> Fn:
        ns = self._namespace(node.value)
        index = node.slice
        if isinstance(index, ast.Constant):
            if not isinstance(index.value, str):
                self.fail(index, f"{ns}[...] needs a string key, got {show(index.value)}")
            return self._key(node, ns, index.value)
        key = self.build(index)  # computed key, e.g. visits[last]: checked when evaluated
        if ns in self.dict_default:
            default = self.dict_default[ns]
            return lambda env: env[ns].get(key(env), default)

        def lookup(env):
            k = key(env)
            try:
                return env[ns][k]
            except (KeyError, TypeError):
                raise ExprError(f"no key {show(k)} in {ns}") from None
        return lookup

    def _List(self, node: ast.List) -> Fn:
        items = [self.build(e) for e in node.elts]
        return lambda env: tuple(f(env) for f in items)

    _Tuple = _List

    # ---- operators
    def _reference(self, node: ast.AST) -> str | None:
        """'task.hops' for task.hops / task['hops'], 'last' for a scalar; None otherwise."""
        if isinstance(node, ast.Name) and node.id in self.scalars:
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return f"{node.value.id}.{node.attr}"
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and isinstance(node.slice, ast.Constant)):
            return f"{node.value.id}.{node.slice.value}"
        return None

    def _check_choice(self, ref_node: ast.AST, const_node: ast.AST):
        ref = self._reference(ref_node)
        if ref is None or ref not in self.choices or not isinstance(const_node, ast.Constant):
            return
        allowed = self.choices[ref]
        if const_node.value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            self.fail(const_node, f"{ref} is never {show(const_node.value)} (its values: {shown})")

    def _Compare(self, node: ast.Compare) -> Fn:
        operands = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, operands, operands[1:]):
            if type(op) not in _COMPARE:
                self.fail(node, f"comparison {type(op).__name__} is not allowed")
            if isinstance(op, (ast.Eq, ast.NotEq)):
                self._check_choice(a, b)
                self._check_choice(b, a)
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(b, (ast.List, ast.Tuple)):
                for e in b.elts:
                    self._check_choice(a, e)
        fns = [self.build(e) for e in operands]
        ops = [_COMPARE[type(op)] for op in node.ops]
        if len(ops) == 1:
            f, a, b = ops[0], fns[0], fns[1]
            return lambda env: f(a(env), b(env))

        def chain(env):
            left = fns[0](env)
            for op, g in zip(ops, fns[1:]):
                right = g(env)
                if not op(left, right):
                    return False
                left = right
            return True
        return chain

    def _BoolOp(self, node: ast.BoolOp) -> Fn:
        fns = [self.build(v) for v in node.values]
        if isinstance(node.op, ast.And):
            def all_(env):
                v = True
                for f in fns:
                    v = f(env)
                    if not v:
                        return v
                return v
            return all_

        def any_(env):
            v = False
            for f in fns:
                v = f(env)
                if v:
                    return v
            return v
        return any_

    def _UnaryOp(self, node: ast.UnaryOp) -> Fn:
        f = self.build(node.operand)
        if isinstance(node.op, ast.Not):
            return lambda env: not f(env)
        if isinstance(node.op, ast.USub):
            return lambda env: -f(env)
        if isinstance(node.op, ast.UAdd):
            return f
        self.fail(node, f"operator {type(node.op).__name__} is not allowed")

    def _BinOp(self, node: ast.BinOp) -> Fn:
        if type(node.op) not in _BINARY:
            self.fail(node, f"operator {type(node.op).__name__} is not allowed (allowed: + - * /)")
        op, a, b = _BINARY[type(node.op)], self.build(node.left), self.build(node.right)
        if op not in (operator.add, operator.mul):
            return lambda env: op(a(env), b(env))
        where = f"at column {node.col_offset + 1}: {show(ast.unparse(node))}"

        def sized(env):
            x, y = a(env), b(env)
            if isinstance(x, _SEQUENCES) or isinstance(y, _SEQUENCES):  # numbers, the usual case, skip this
                n = _built_length(op, x, y) or 0
                if n > MAX_ITEMS:
                    raise ExprError(f"{where} would build a sequence of {n} items (at most {MAX_ITEMS})")
            return op(x, y)
        if not any(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript)) for n in ast.walk(node)):
            try:  # constant operands: a too long result is an error when the spec loads, not mid-trace
                sized({})
            except ExprError:
                raise
            except Exception:
                pass  # e.g. 'a' + 1 in a branch never taken: an error only if evaluated, as before
        return sized

    def _IfExp(self, node: ast.IfExp) -> Fn:
        c, a, b = self.build(node.test), self.build(node.body), self.build(node.orelse)
        return lambda env: a(env) if c(env) else b(env)

    def _Call(self, node: ast.Call) -> Fn:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            self.fail(node, f"only {', '.join(FUNCTIONS)} can be called")
        if node.keywords or len(node.args) < 2 or any(isinstance(a, ast.Starred) for a in node.args):
            self.fail(node, f"{node.func.id}() takes two or more plain arguments")
        f, args = FUNCTIONS[node.func.id], [self.build(a) for a in node.args]
        return lambda env: f(*(g(env) for g in args))
