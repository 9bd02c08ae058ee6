"""`Extremes` (per-class min next use / max reuse probability over workflows, lazy heaps) against
a rescan after every update: the same values and exactly the classes whose values changed."""

from hypothesis import given, settings, strategies as st

from pbkv.policy.extremes import Extremes

N = 3
VALUES = st.sampled_from([0.0, 0.5, 1.0, 2.0, float("inf")])
OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.lists(VALUES, min_size=N, max_size=N),
              st.lists(st.sampled_from([0.0, 0.1, 0.7, 1.0]), min_size=N, max_size=N)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
), max_size=80)


def rescan(when, prob):
    first = [min((w[a] for w in when.values()), default=float("inf")) for a in range(N)]
    pmax = [max([0.0, *(p[a] for p in prob.values())]) for a in range(N)]
    return first, pmax


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_extremes_match_a_rescan_and_report_exactly_the_moved_classes(ops):
    ex, when, prob = Extremes(), {}, {}
    assert ex.reset(N, when, prob) == []
    for op in ops:
        before = rescan(when, prob)
        if op[0] == "set":
            _, w, row, p = op
            when[w], prob[w] = row, p
            moved = ex.set(w, row, p)
        else:
            when.pop(op[1], None)
            prob.pop(op[1], None)
            moved = ex.remove(op[1])
        after = rescan(when, prob)
        assert (ex.first, ex.pmax) == after
        assert moved == [a for a in range(N) if (before[0][a], before[1][a]) != (after[0][a], after[1][a])]


def test_reset_skips_rows_of_another_class_count():
    ex = Extremes()
    moved = ex.reset(2, {1: [3.0, 4.0], 2: [1.0, 1.0, 1.0]}, {1: [0.5, 0.0], 2: [1.0, 1.0, 1.0]})
    assert (ex.first, ex.pmax, moved) == ([3.0, 4.0], [0.5, 0.0], [0, 1])
