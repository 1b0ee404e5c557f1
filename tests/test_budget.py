"""planning.budget.plan_within with the search replaced by a table: (time, peak) per memory
price, as the mixture of experts on 8 x 8 v5p chips within 2.91 GiB planned them."""
from types import SimpleNamespace

from autopar.planning import budget
from autopar.planning.assemble import Candidate
from autopar.plan_stats import SearchStats

GB = 10**9
LIMIT = int(3.13 * GB)


def candidate(ms: float, peak: float) -> Candidate:
    return Candidate((ms, peak), SimpleNamespace(total_s=ms / 1e3),
                     SimpleNamespace(peak_bytes=int(peak * GB)),
                     SearchStats(seconds={"search_s": 0.1}))


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
