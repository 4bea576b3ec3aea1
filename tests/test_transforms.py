"""Named transforms that derive MTUP's auxiliary fields."""
import pytest

from workflow_scripts.data.transforms import TRANSFORMS, answer_kind, penman_skeleton


def test_transforms_are_registered_by_name():
    assert TRANSFORMS["answer_kind"] is answer_kind
    assert TRANSFORMS["penman_skeleton"] is penman_skeleton


@pytest.mark.parametrize("answer, kind", [
    ("12", "number"), ("7.5", "number"), ("1,200", "number"), ("45%", "number"), ("$3", "number"),
    ("-4", "number"), (" 64 ", "number"), ("yes", "yes/no"), ("No", "yes/no"), ("red", "text"),
    ("12 apples", "text"), ("Modern", "text"), ("", "text"),
])
def test_answer_kind(answer, kind):
    assert answer_kind(answer) == kind


@pytest.mark.parametrize("graph, skeleton", [
    ("(w / want-01 :ARG0 (b / boy))", "(want-01 :ARG0 (boy))"),
    # a re-entrant variable becomes the concept it names (MTUP's Task 1)
    ("(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))", "(want-01 :ARG0 (boy) :ARG1 (go-02 :ARG0 (boy)))"),
    ("(s/see-01 :ARG0 (b/boy) :ARG1 b)", "(see-01 :ARG0 (boy) :ARG1 (boy))"),
    # numbered variables, constants, polarity and strings stay as they are
    ("(w / want-01 :ARG0 (t / teacher :mod (b / big)) :ARG1 (b2 / bake-01 :ARG0 t))",
     "(want-01 :ARG0 (teacher :mod (big)) :ARG1 (bake-01 :ARG0 (teacher)))"),
    ('(c / city :name (n / name :op1 "New" :op2 "York"))', '(city :name (name :op1 "New" :op2 "York"))'),
    ("(r / run-02 :polarity - :ARG0 (d / dog) :quant 5)", "(run-02 :polarity - :ARG0 (dog) :quant 5)"),
    ("(w / want-01\n    :ARG0 (b / boy))", "(want-01 :ARG0 (boy))"),
])
def test_penman_skeleton(graph, skeleton):
    assert penman_skeleton(graph) == skeleton


@pytest.mark.parametrize("graph", ["(s / sleep-01 :ARG0 (b / boy)", "the boy sleeps", ""])
def test_penman_skeleton_rejects_what_is_not_a_graph(graph):
    with pytest.raises(ValueError):
        penman_skeleton(graph)
