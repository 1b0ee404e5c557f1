"""Sharding rules: factor notation per primitive, and the strategies that follow from it."""
from autopar.rules.factors import (Rule, Spec, Strategy, enumerate_strategies, follow,
                                   from_partition_spec, replicated, spec_str, strategy,
                                   to_partition_spec)
from autopar.rules.kinds import ELEMENTWISE
from autopar.rules.table import RULES, replicated_rule, rule_for

__all__ = ["Rule", "Spec", "Strategy", "enumerate_strategies", "follow", "from_partition_spec",
           "replicated", "spec_str", "strategy", "to_partition_spec", "ELEMENTWISE", "RULES",
           "replicated_rule", "rule_for"]
