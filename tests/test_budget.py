"""planning.budget.plan_within with the search replaced by a table: (time, peak) per memory
price, as the mixture of experts on 8 x 8 v5p chips within 2.91 GiB planned them."""
import math
from types import SimpleNamespace

import pytest

from autopar.planning import budget
from autopar.planning.assemble import Candidate
from autopar.plan_stats import SearchStats

GB = 10**9
LIMIT = int(3.13 * GB)


def candidate(ms: float, peak: float, exact: bool = False) -> Candidate:
    return Candidate((ms, peak), lambda: SimpleNamespace(total_s=ms / 1e3),
                     SimpleNamespace(peak_bytes=int(peak * GB)),
                     SearchStats(exact=exact, seconds={"search_s": 0.1}))


def by_price(start: float):
    """The plans of the first price and above keep fewer bytes but peak over the limit, or
    just within it and slowly; a sixteenth of the first price to a hundredth fits faster."""
    asked = []

    def attempt(price: float, recompute: frozenset, cap) -> Candidate:
        asked.append(price)
        if price == 0:
            return candidate(74.6, 5.52)
        if price >= 8 * start:
            return candidate(88.9, 3.12)
        if price >= start / 10:
            return candidate(85.8, 3.23)
        if price >= start / 100:
            return candidate(77.0, 2.65)
        return candidate(76.9, 3.77)
    return attempt, asked


def test_prices_below_the_first_are_tried_where_it_does_not_fit():
    """The peak is not monotone in the price: the budget looks below the first price."""
    start = 74.6e-3 / (5.52 * GB)
    attempt, asked = by_price(start)
    chosen = budget.plan_within(attempt, None, None, LIMIT, None)
    assert chosen.decisions == (77.0, 2.65)
    assert chosen.stats["memory_price_s_per_byte"] < start
    assert [p for p in asked if 0 < p < start] == [start / 8, start / 64, start / 512]


def test_where_no_rising_price_fits_prices_below_the_first_are_tried(monkeypatch):
    """The mixture of experts on 8 x 8 v5p chips within 2.91 GiB, as estimated at 4856f3c:
    from the first price up every plan peaks at 3.38 GB and recomputing layers finds none
    (here: none to recompute); at a sixty-fourth of the first price one peaks at 2.82 GB and
    is faster. Tried last, before nothing fits is said."""
    monkeypatch.setattr(budget, "_layers_to_recompute", lambda *args: frozenset())
    start = 74.3e-3 / (5.58 * GB)
    asked = []

    def attempt(price: float, recompute: frozenset, cap) -> Candidate:
        asked.append(price)
        if price == 0:
            return candidate(74.3, 5.58)
        if start / 100 < price < start / 10:
            return candidate(76.7, 2.82)
        return candidate(88.6, 3.38) if price >= start else candidate(85.4, 3.52)
    chosen = budget.plan_within(attempt, None, None, int(2.98 * GB), None)
    assert chosen.decisions == (76.7, 2.82)
    below = [p for p in asked if 0 < p < start * (1 - 1e-9)]
    assert below == pytest.approx([start / 8, start / 64, start / 512], rel=1e-12)


def test_where_prices_stall_layers_are_recomputed_before_the_plan_slows_down(monkeypatch):
    """A deep model's activations: rising prices buy no memory past the first (the peak
    stays over the limit) and only a price 8**6 higher fits, at three times the time. The
    budget stops raising where the peak stalls, recomputes layers, and keeps the faster plan
    that fits with them; the plain prices are not raised further, as their plans are already
    slower."""
    monkeypatch.setattr(budget, "_layers_to_recompute", lambda *args: frozenset({7}))
    start = 580e-3 / (78.9 * GB)
    asked = []

    def attempt(price: float, recompute: frozenset, cap) -> Candidate:
        asked.append((price, bool(recompute)))
        if price == 0:
            return candidate(580.0, 78.9)
        if recompute:
            return candidate(880.0, 15.9) if price >= 4 * start else candidate(724.0, 30.8)
        if price >= 8**6 * start:
            return candidate(2900.0, 15.5)
        if price < 4 * start:
            return candidate(722.0, 33.2)
        return candidate(870.0 + 10 * math.log(price / start, 8), 18.3)  # 880 ms at 8x
    chosen = budget.plan_within(attempt, None, None, int(16 * GB), None)
    assert chosen.decisions == (880.0, 15.9)
    plain = [p for p, recomputed in asked if p > 0 and not recomputed]
    assert plain == [start, 8 * start, 64 * start]  # stalled at the third: 18.3 after 18.3
    recomputed = [p for p, recomputed in asked if recomputed]
    assert recomputed[0] == 8 * start  # from the price of the leanest plan (the first)
    assert chosen.stats["memory_solves"] == len(asked)


def test_below_a_price_that_fits_the_search_goes_to_where_two_plans_cost_the_same(monkeypatch):
    """The first price fits. Between the free plan A (over the limit) and the plan B that fits,
    a plan C fits too and is faster. The price at which A and B cost the same (time plus price
    times kept bytes) finds C; the price at which A and C do finds A again: the plans are
    adjacent, and the search stops after two prices, where bisection takes five (and does,
    where the searches are not exact)."""
    monkeypatch.setattr(budget, "kept_bytes", lambda graph, decisions, mesh: decisions[1] * GB)
    plans = {"A": (1340.0, 190.0), "C": (1380.0, 40.0), "B": (1408.0, 15.0)}

    def best_at(price: float) -> tuple[float, float]:  # an exact search: least time + price x kept
        return min(plans.values(), key=lambda p: p[0] / 1e3 + price * p[1] * GB)
    asked = []

    def attempt(price: float, recompute: frozenset, cap) -> Candidate:
        asked.append(price)
        return candidate(*best_at(price), exact=True)
    start = 1.340 / (190.0 * GB)
    assert best_at(start) == plans["B"]
    chosen = budget.plan_within(attempt, None, None, int(95 * GB), None)
    assert chosen.decisions == plans["C"]
    even_ab = (1.408 - 1.340) / ((190.0 - 15.0) * GB)
    even_ac = (1.380 - 1.340) / ((190.0 - 40.0) * GB)
    assert asked[:2] == [0.0, start]
    assert asked[2:] == pytest.approx([even_ab, even_ac], rel=1e-12)
    asked.clear()
    inexact = budget.plan_within(lambda price, recompute, cap: candidate(
        *attempt(price, recompute, cap).decisions), None, None, int(95 * GB), None)
    assert len(asked) == 2 + budget.BISECTIONS and inexact.decisions == plans["C"]
