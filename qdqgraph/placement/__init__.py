"""Placement: which input edges get Q/DQ, decided by the rules in rules/placement.toml."""
from .planner import CONDITIONS, Ctx, Decision, Plan, Selection, Site, explain, plan_placement
from .ruleset import Rule, RuleSet, load_ruleset

__all__ = ["CONDITIONS", "Ctx", "Decision", "Plan", "Selection", "Site", "explain", "plan_placement", "Rule",
           "RuleSet", "load_ruleset"]
