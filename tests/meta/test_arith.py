"""The arithmetic task: generator, reference solutions, answer and step checkers."""

from __future__ import annotations

import pytest

from decodekit.meta.tasks.arith import (
    ArithConfig,
    Problem,
    check_answer,
    check_steps,
    extract_answer,
    format_prompt,
    format_solution,
    generate_problems,
    parse_question,
    solve,
    split_steps,
)

Q = "17+4*3-8"  # = 21


def test_reference_solution_by_hand():
    assert format_prompt(Q) == "Compute: 17+4*3-8=\n"
    assert format_solution(Q) == "4*3=12\n17+12=29\n29-8=21\nAnswer: 21"
    assert format_solution("14-2-9-17") == "14-2=12\n12-9=3\n3-17=-14\nAnswer: -14"
    assert format_solution("2*3*4", delimiter=" | ") == "2*3=6 | 6*4=24 | Answer: 24"
    assert solve(parse_question("5-8*2")) == [(8, "*", 2, 16), (5, "-", 16, -11)]


def test_parse_question_accepts_bare_question_and_prompt():
    expected = Problem((17, 4, 3, 8), ("+", "*", "-"))
    for text in (Q, Q + "=", format_prompt(Q), " Compute: 17 + 4*3 - 8 = "):
        assert parse_question(text) == expected
    assert parse_question(Q).answer == 21
    with pytest.raises(ValueError, match="not an arithmetic question"):
        parse_question("17+(4*3)")


def test_answer_checker_and_extractor():
    assert extract_answer("4*3=12\nAnswer: 21") == 21
    assert extract_answer("Answer: -7\nAnswer: 3") == -7  # the first answer counts
    assert extract_answer("4*3=12\n17+12=29") is None
    assert check_answer(Q, "4*3=12\n17+12=29\n29-8=21\nAnswer: 21")
    assert not check_answer(Q, "4*3=12\n17+12=29\n29-8=20\nAnswer: 20")
    assert not check_answer(Q, "4*3=12\n17+12=29")  # no answer line
    # outcome reward only: a wrong step with a right final answer still passes
    assert check_answer(Q, "4*3=13\n17+13=29\n29-8=21\nAnswer: 21")


def test_step_checker_on_correct_solution():
    assert check_steps(Q, ["4*3=12", "17+12=29", "29-8=21", "Answer: 21"]) == [True] * 4
    assert check_steps(Q, format_solution(Q)) == [True] * 4  # a whole solution is split


def test_step_checker_catches_wrong_intermediate_step_with_right_answer():
    # 17+12 is 29, not 30; the next step "compensates" and the answer is right
    steps = ["4*3=12", "17+12=30", "30-9=21", "Answer: 21"]
    assert check_answer(Q, "\n".join(steps))
    assert check_steps(Q, steps) == [True, False, False, False]


@pytest.mark.parametrize(
    "question, steps, expected",
    [
        # precedence: adding before multiplying is a wrong step even if the sum is right
        (Q, ["17+4=21", "21*3=63", "Answer: 21"], [False, False, False]),
        # a step that reduces numbers not in the expression
        (Q, ["4*3=12", "12+12=24"], [True, False]),
        # a wrong final answer after correct steps
        (Q, ["4*3=12", "17+12=29", "29-8=21", "Answer: 22"], [True, True, True, False]),
        # left associativity: 10-3+2 is not 10-(3+2)
        ("10-3+2", ["3+2=5", "10-5=5", "Answer: 5"], [False, False, False]),
        # any order that respects precedence is fine: 4*5 before 2*3
        ("2*3+4*5", ["4*5=20", "2*3=6", "6+20=26", "Answer: 26"], [True] * 4),
        # 17+12-8: 12-8 may go first since 17+(12-8) = 17+12-8
        (Q, ["4*3=12", "12-8=4", "17+4=21", "Answer: 21"], [True] * 4),
        # negative intermediate results
        ("5-8+1", ["5-8=-3", "-3+1=-2", "Answer: -2"], [True] * 3),
        # garbage, and anything after the answer line
        (Q, ["4*3=12", "hello"], [True, False]),
        (Q, ["4*3=12", "17+12=29", "29-8=21", "Answer: 21", "1+1=2"], [True] * 4 + [False]),
    ],
)
def test_step_checker_cases(question, steps, expected):
    assert check_steps(question, steps) == expected


def test_split_steps_with_custom_delimiter():
    solution = format_solution(Q, delimiter="; ")
    assert split_steps(solution, delimiter="; ") == ["4*3=12", "17+12=29", "29-8=21", "Answer: 21"]
    assert check_steps(Q, solution, delimiter="; ") == [True] * 4
    assert split_steps("4*3=12\n\n Answer: 21 \n") == ["4*3=12", "Answer: 21"]


def test_generator_is_deterministic_by_seed_and_respects_config():
    config = ArithConfig(min_ops=2, max_ops=3, max_operand=9)
    a, b = generate_problems(50, seed=7, config=config), generate_problems(50, 7, config)
    assert a == b
    assert a != generate_problems(50, seed=8, config=config)
    assert all(2 <= len(p.ops) <= 3 and all(1 <= x <= 9 for x in p.numbers) for p in a)
    assert {len(p.ops) for p in a} == {2, 3}
    # every reference solution passes both checkers
    for p in a:
        solution = format_solution(p)
        assert check_answer(p.question, solution)
        assert all(check_steps(p.question, solution))
        assert parse_question(format_prompt(p)) == p


@pytest.mark.parametrize(
    "kwargs", [{"min_ops": 0}, {"min_ops": 3, "max_ops": 2}, {"max_operand": 0}]
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        ArithConfig(**kwargs)
