import pytest

from ibpo.rewards import extract_answer, math_reward


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("7 + 5 = 12", "12", 1.0),
        ("9 + 7 = 26", "16", 0.0),  # a restated expression must not count
        ("The answer is 16.", "16", 1.0),
        ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
        ("<think>maybe 9? no</think>The answer: 12", "12", 1.0),
        ("<think>it is 12</think>", "12", 0.0),  # the thinking alone is not an answer
        ("Answer: 1,000", "1000", 1.0),
        ("#### 72", "72", 1.0),
        ("I do not know", "3", 0.0),
        ("-4", "-4", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ],
)
def test_math_reward(completion, gold, expected):
    assert math_reward(completion, gold) == expected


def test_extract_answer_prefers_boxed_then_answer_line_then_last_number():
    assert extract_answer("3 then \\boxed{4} then 5") == "4"
    assert extract_answer("Answer: 7\nbut also 9") == "7"
    assert extract_answer("3 and 5") == "5"
    assert extract_answer("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
