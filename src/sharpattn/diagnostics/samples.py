"""Two short text samples for the extreme-token diagnostics: prose and code (written for sharpattn).

Guo et al. find heads that are dormant (attention sinks) on prose and active on code; these give
``sharpattn diagnose`` one input from each domain without any download.
"""

__all__ = ["CODE", "PROSE", "SAMPLES"]

PROSE = """\
The village sat where the river bent twice before reaching the sea. In summer the water ran low and \
warm, and children waded across to the far bank to pick blackberries along the old wall. In winter \
the river rose, brown and fast, and the ferryman kept his boat tied high on the slope behind his \
house. Most families had lived there for generations. They knew which fields flooded first, which \
road stayed dry in March, and which of the neighbours could be trusted to return a borrowed ladder. \
When the railway finally came, people argued for a year about whether it would bring customers or \
only carry their sons away to the city. In the end it did both, and the village learned to live \
with the sound of the evening train crossing the bridge."""

CODE = '''\
import math
from dataclasses import dataclass


@dataclass
class Interval:
    lo: float
    hi: float

    def width(self) -> float:
        return self.hi - self.lo

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi


def merge(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping intervals; the result is sorted by its lower ends."""
    out: list[Interval] = []
    for iv in sorted(intervals, key=lambda i: i.lo):
        if out and iv.lo <= out[-1].hi:
            out[-1] = Interval(out[-1].lo, max(out[-1].hi, iv.hi))
        else:
            out.append(iv)
    return out


def log_sum_exp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


if __name__ == "__main__":
    spans = [Interval(0, 2), Interval(1, 3), Interval(5, 6)]
    print(merge(spans), log_sum_exp([1.0, 2.0, 3.0]))
'''

SAMPLES = {"prose": PROSE, "code": CODE}
