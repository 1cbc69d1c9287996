"""Placement: which input edges get Q/DQ, decided by the rules in rules/placement.toml.

    plan.py        the plan types (Site, Decision, Plan) and the user's Selection
    ruleset.py     placement rule files read and checked
    conditions.py  the conditions rules may name (a closed registry)
    planner.py     plan_placement (pure) and explain
    refine.py      P14: INT8 regions too small to pay for their reformats go back to float
                   (imported where used: it simulates the plan, so it needs the simulator)
"""
from .conditions import CONDITIONS
from .plan import Decision, Plan, Selection, Site
from .planner import explain, plan_placement
from .ruleset import RegionRule, Rule, RuleSet, load_ruleset

__all__ = ["CONDITIONS", "Decision", "Plan", "Selection", "Site", "explain", "plan_placement", "RegionRule", "Rule",
           "RuleSet", "load_ruleset"]
