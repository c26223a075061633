"""Config expressions: the small language recipes use to say how a family reads config.json.

An expression is a Python expression over a fixed set of names — the `model` values computed so
far (`hidden_size`, `head_dim`, `moe.expert_intermediate_size`, …), `num_layers`, `dtype` (the
checkpoint's weight dtype) — and a fixed set of functions: `cfg(key[, default])` reads config.json,
`has(key)`, `get(obj, key[, default])`, arithmetic helpers and the THIN-specific mappings below.

It is parsed with `ast` and evaluated node by node from a whitelist: no attribute access except
dotted model names, no imports, no lambdas, bounded sizes. A recipe is data, not code.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from thinconv.errors import ConversionError, RecipeError

MAX_LENGTH = 2000  # characters in one expression
MAX_ITEMS = 1_000_000  # elements a range / list / repetition may produce
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
           ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
           ast.Is: operator.is_, ast.IsNot: operator.is_not}


class Namespace:
    """Dotted names (`moe.expert_intermediate_size`) over a nested dict."""

    def __init__(self, data: Mapping[str, Any], path: str = ""):
        self._data, self._path = data, path

    def attr(self, name: str) -> Any:
        if name not in self._data:
            raise KeyError(f"{self._path}.{name}" if self._path else name)
        value = self._data[name]
        return Namespace(value, f"{self._path}.{name}" if self._path else name) if isinstance(value, dict) else value


def parse(text: str, where: str) -> ast.Expression:
    """Parse and check an expression once (a RecipeError names `where` on any problem)."""
    if not isinstance(text, str) or not text.strip():
        raise RecipeError(f"{where}: expected an expression (a string)")
    if len(text) > MAX_LENGTH:
        raise RecipeError(f"{where}: expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise RecipeError(f"{where}: not a valid expression ({getattr(e, 'msg', e)})") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise RecipeError(f"{where}: {type(node).__name__} is not allowed in a recipe expression")
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            raise RecipeError(f"{where}: only the built-in functions can be called")
        if isinstance(node, ast.comprehension) and (node.is_async or not isinstance(node.target, ast.Name)):
            raise RecipeError(f"{where}: a comprehension binds one plain name")
    return tree


_ALLOWED = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.BinOp, ast.UnaryOp,
            ast.BoolOp, ast.Compare, ast.IfExp, ast.Call, ast.keyword, ast.List, ast.Tuple, ast.Dict, ast.Subscript,
            ast.Slice, ast.ListComp, ast.comprehension, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd,
            *_BINOPS, *_CMPOPS)


def evaluate(tree: ast.Expression, names: Mapping[str, Any], functions: Mapping[str, Callable], where: str) -> Any:
    """The value of a parsed expression; ConversionError (naming `where`) on any failure."""
    try:
        return _plain(_Eval(names, functions).visit(tree.body))
    except ConversionError:
        raise
    except KeyError as e:
        raise ConversionError(f"{where}: unknown name {e.args[0]!r}") from None
    except RecursionError:
        raise ConversionError(f"{where}: expression nested too deeply") from None
    except (TypeError, ValueError, ArithmeticError, IndexError, AttributeError) as e:
        raise ConversionError(f"{where}: {type(e).__name__}: {e}") from None


class _Eval:
    def __init__(self, names: Mapping[str, Any], functions: Mapping[str, Callable]):
        self.scopes = [dict(names)]
        self.functions = functions

    def visit(self, node: ast.AST) -> Any:
        return getattr(self, "v_" + type(node).__name__)(node)

    def v_Constant(self, n: ast.Constant) -> Any:
        return n.value

    def v_Name(self, n: ast.Name) -> Any:
        for scope in reversed(self.scopes):
            if n.id in scope:
                v = scope[n.id]
                return Namespace(v, n.id) if isinstance(v, dict) else v
        if n.id in ("true", "True"):
            return True
        if n.id in ("false", "False"):
            return False
        if n.id in ("null", "None"):
            return None
        raise KeyError(n.id)

    def v_Attribute(self, n: ast.Attribute) -> Any:
        base = self.visit(n.value)
        if not isinstance(base, Namespace):
            raise TypeError(f"'.{n.attr}' applies only to model names (e.g. moe.num_experts)")
        return base.attr(n.attr)

    def v_BinOp(self, n: ast.BinOp) -> Any:
        a, b = self.visit(n.left), self.visit(n.right)
        if isinstance(n.op, ast.Pow) and isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(b) > 1024:
            raise ValueError(f"exponent {b} is too large")
        if isinstance(n.op, ast.Mult) and (isinstance(a, (list, str)) or isinstance(b, (list, str))):
            seq, count = (a, b) if isinstance(a, (list, str)) else (b, a)
            if isinstance(count, int) and count * max(len(seq), 1) > MAX_ITEMS:
                raise ValueError("repetition too long")
        return _BINOPS[type(n.op)](a, b)

    def v_UnaryOp(self, n: ast.UnaryOp) -> Any:
        v = self.visit(n.operand)
        return {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}[type(n.op)](v)

    def v_BoolOp(self, n: ast.BoolOp) -> Any:
        v = None
        for item in n.values:
            v = self.visit(item)
            if isinstance(n.op, ast.And) and not v or isinstance(n.op, ast.Or) and v:
                return v
        return v

    def v_Compare(self, n: ast.Compare) -> bool:
        left = self.visit(n.left)
        for op, right_node in zip(n.ops, n.comparators):
            right = self.visit(right_node)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True

    def v_IfExp(self, n: ast.IfExp) -> Any:
        return self.visit(n.body) if self.visit(n.test) else self.visit(n.orelse)

    def v_Call(self, n: ast.Call) -> Any:
        name = n.func.id  # parse() allows only plain names
        if name not in self.functions:
            raise KeyError(f"{name}()")
        args = [self.visit(a) for a in n.args]
        kwargs = {k.arg: self.visit(k.value) for k in n.keywords}
        return self.functions[name](*args, **kwargs)

    def v_List(self, n: ast.List) -> list:
        return [self.visit(e) for e in n.elts]

    def v_Tuple(self, n: ast.Tuple) -> list:
        return [self.visit(e) for e in n.elts]

    def v_Dict(self, n: ast.Dict) -> dict:
        return {self.visit(k): _plain(self.visit(v)) for k, v in zip(n.keys, n.values)}

    def v_Subscript(self, n: ast.Subscript) -> Any:
        base = self.visit(n.value)
        if isinstance(n.slice, ast.Slice):
            parts = [None if p is None else self.visit(p) for p in (n.slice.lower, n.slice.upper, n.slice.step)]
            return base[slice(*parts)]
        return base[self.visit(n.slice)]

    def v_ListComp(self, n: ast.ListComp) -> list:
        if len(n.generators) != 1:
            raise ValueError("one `for` per comprehension")
        gen = n.generators[0]
        items = self.visit(gen.iter)
        out = []
        for item in items:
            self.scopes.append({gen.target.id: item})
            try:
                if all(self.visit(cond) for cond in gen.ifs):
                    out.append(self.visit(n.elt))
            finally:
                self.scopes.pop()
            if len(out) > MAX_ITEMS:
                raise ValueError("comprehension too long")
        return out


def _plain(v: Any) -> Any:
    """A value as data: a model name that holds an object (`rope.scaling`) evaluates to a Namespace,
    for dotted access; as a result, or inside one, it is a copy of the object itself."""
    if isinstance(v, Namespace):
        return copy.deepcopy(v._data)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def bounded_range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise ValueError(f"range of {len(r)} items is too long")
    return r


BASE_FUNCTIONS: dict[str, Callable] = {
    "sqrt": math.sqrt, "log": math.log, "exp": math.exp, "min": min, "max": max, "abs": abs, "int": int,
    "float": float, "bool": bool, "len": len, "range": bounded_range, "sum": sum, "any": any, "all": all,
    "round": round, "list": list,
}
