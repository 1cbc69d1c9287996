"""Conditions.evaluate keeps each rule's parsed `when`; the answers stay per node and per context."""
from types import SimpleNamespace

from qdqgraph.rulebook.match import Conditions, Context, hit, miss


def _registry():
    conds = Conditions("a test")
    seen = []

    @conds.register("big", captures=("size",))
    def big(ctx, node, arg):
        seen.append((node.name, arg))
        limit = int(arg or 0)
        return hit(f"{node.name} is big", size=node.size) if node.size > limit else miss(f"{node.name} is small")

    @conds.register("tensor_is")
    def tensor_is(ctx, node, arg):
        return hit() if ctx.tensor == arg else miss(f"reached through {ctx.tensor}")

    return conds, seen


def test_two_nodes_evaluated_with_one_when_get_their_own_answers():
    conds, seen = _registry()
    when = ("big:5", "tensor_is:x")
    small, large = SimpleNamespace(name="a", size=3), SimpleNamespace(name="b", size=9)
    ctx = Context(graph=None, tensor="x")
    assert not conds.evaluate(when, ctx, small).ok
    m = conds.evaluate(when, ctx, large)
    assert m.ok and m.reason == "b is big" and m.captures == {"size": 9}
    assert seen == [("a", "5"), ("b", "5")]          # each node is asked, nothing is reused across nodes


def test_the_same_node_in_another_context_is_asked_again():
    conds, _ = _registry()
    node = SimpleNamespace(name="b", size=9)
    assert conds.evaluate(("tensor_is:x",), Context(graph=None, tensor="x"), node).ok
    m = conds.evaluate(("tensor_is:x",), Context(graph=None, tensor="y"), node)
    assert not m.ok and m.reason == "reached through y"


def test_a_negated_condition_and_a_list_when_read_as_the_tuple():
    conds, _ = _registry()
    node = SimpleNamespace(name="b", size=9)
    ctx = Context(graph=None, tensor="x")
    as_list = conds.evaluate(["not big:5"], ctx, node)
    as_tuple = conds.evaluate(("not big:5",), ctx, node)
    assert as_list == as_tuple and not as_list.ok and as_list.reason == "big:5 holds (b is big)"
    assert conds.evaluate(("not big:50",), ctx, node).ok


def test_registries_do_not_share_parsed_rules():
    first, _ = _registry()
    second = Conditions("another test")

    @second.register("big")
    def never(ctx, node, arg):
        return miss("the other registry's big")

    node = SimpleNamespace(name="b", size=9)
    ctx = Context(graph=None)
    assert first.evaluate(("big",), ctx, node).ok
    assert second.evaluate(("big",), ctx, node).reason == "the other registry's big"
