"""Refinement rounds with feedback, pipelines of generators and tools, the calculator."""

from __future__ import annotations

import pytest
from meta_toys import ScriptedGenerator

from decodekit.meta.budget import Budget
from decodekit.meta.pipeline import calculator, generate_step, generate_with_tool, run_pipeline, tool_step
from decodekit.meta.refinement import Feedback, refine, verifier_feedback


def test_refine_stops_on_success_with_feedback_in_the_prompt():
    gen = ScriptedGenerator(["wrong", "still wrong", "right", "never"])

    def feedback(prompt, output):
        return (output == "right", f"{output!r} is not right")

    result = refine(gen, "Q: ", feedback, rounds=5, template="{prompt}{previous} [{feedback}] ")
    assert result.text == "right" and result.tallies == {"accepted": True, "attempts": 3}
    assert [p for p, _ in gen.requests] == [
        "Q: ", "Q: wrong ['wrong' is not right] ", "Q: still wrong ['still wrong' is not right] "]
    assert [c.score for c in result.candidates] == [0.0, 0.0, 1.0]
    assert result.budget["generator_calls"] == 3 and result.budget["scorer_calls"] == 3


def test_refine_gives_up_after_k_rounds_and_returns_the_last():
    gen = ScriptedGenerator(["a", "b", "c", "d"])
    result = refine(gen, "Q", lambda p, o: False, rounds=2)
    assert result.tallies == {"accepted": False, "attempts": 3} and result.text == "c"
    assert refine(ScriptedGenerator(["a"]), "Q", lambda p, o: False, rounds=0).tallies["attempts"] == 1


def test_refine_continues_from_a_verified_prefix():
    # a step checker keeps the correct lines and asks for the rest again
    gen = ScriptedGenerator(["1\n2\n9", "3", "4"])

    def check(prompt, output):
        lines = output.split("\n")
        good = [x for x, want in zip(lines, ["1", "2", "3"]) if x == want]
        ok = len(good) == 3 and len(lines) == 3
        return Feedback(ok, "wrong line", keep="".join(x + "\n" for x in good))

    result = refine(gen, "Q\n", check, rounds=3)
    assert result.text == "1\n2\n3" and result.tallies["attempts"] == 2
    assert gen.requests[1][0] == "Q\n1\n2\n"  # the prompt plus the verified prefix


def test_verifier_feedback_and_bad_feedback():
    gen = ScriptedGenerator(["ab", "abcd"])
    result = refine(gen, "Q", verifier_feedback(len, threshold=3), rounds=3)
    assert result.text == "abcd" and "scored this 2, below 3" in result.candidates[0].note
    # a score equal to the threshold reaches it
    result = refine(ScriptedGenerator(["ab", "abc", "abcd"]), "Q", verifier_feedback(len, threshold=3))
    assert result.text == "abc" and result.tallies == {"accepted": True, "attempts": 2}
    with pytest.raises(TypeError, match="feedback on attempt 0 returned 'yes'"):
        refine(ScriptedGenerator(["a"]), "Q", lambda p, o: "yes")
    with pytest.raises(ValueError, match="rounds must be an integer >= 0"):
        refine(ScriptedGenerator(["a"]), "Q", lambda p, o: True, rounds=-1)


def test_calculator():
    assert calculator("2*(3+4)") == "14"
    assert calculator(" 17+4*3-8 ") == "21"
    assert calculator("7/2") == "3.5" and calculator("-3--4") == "1"
    for bad in ("__import__('os')", "2**10", "x+1", "1/0", "3+"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_pipeline_feeds_outputs_forward_with_a_tool_between():
    replies = {"Write 2 times 7:": "2*7", "The result 14 means": " done"}
    gen = ScriptedGenerator(lambda prompt, i: replies[prompt])
    steps = [
        ("expression", generate_step(gen, "Write {input}:")),
        ("value", tool_step(calculator)),
        ("answer", generate_step(gen, "The result {value} means")),
    ]
    result = run_pipeline(steps, "2 times 7")
    assert result.text == " done"
    assert result.tallies["expression"] == "2*7" and result.tallies["value"] == "14"
    assert [c.note for c in result.candidates] == ["expression", "value", "answer"]
    assert result.budget["generator_calls"] == 2 and result.budget["tool_calls"] == 1
    with pytest.raises(ValueError, match="unique"):
        run_pipeline([("input", tool_step(str))], "x")
    stopped = run_pipeline(steps, "2 times 7", Budget(limits={"generator_calls": 1}))
    assert stopped.stopped_by_budget and [c.note for c in stopped.candidates] == ["expression"]


def test_generate_with_tool_fills_results_between_steps():
    def model(prompt, i):
        tail = prompt.split("\n", 1)[1]
        # the "model" proposes operations but cannot multiply; the calculator does it
        return {"": ("4*3", "="), "4*3=12\n": ("17+12", "="), "4*3=12\n17+12=29\n": ("Answer: 29", 0)}[tail]

    gen = ScriptedGenerator(model)
    result = generate_with_tool(gen, "Compute: 17+4*3=\n", budget=Budget())
    assert result.text == "4*3=12\n17+12=29\nAnswer: 29" and result.chosen.error is None
    assert result.budget["tool_calls"] == 2 and result.budget["generator_calls"] == 3


def test_generate_with_tool_records_a_tool_error():
    gen = ScriptedGenerator([("4*", "=")])
    result = generate_with_tool(gen, "Compute: 4*3=\n")
    assert result.text == "4*" and "tool failed on '4*'" in result.chosen.error
